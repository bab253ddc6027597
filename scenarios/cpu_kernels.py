"""The CPU decode kernels against the torch paths they replace, side by side in one run, on
SmolLM2-135M's shapes with caches cold (every weight and KV byte comes from memory):

- linears: all 30 layers' q/k/v, o, gate/up and down, at 1, 32 and 512 rows, plus the lm_head
  at decode's row counts (prefill computes logits for its last token only), in each dtype with a
  native kernel this CPU runs (radixkv/cpu/csrc/packed_linear.c: AMX tiles, AVX512_BF16 for bf16;
  linear_f32.c: AVX2 for fp32) vs oneDNN with prepacked weights (bf16) vs plain F.linear;
- decode attention: 32 requests x 1,032 tokens over 30 layers' paged KV, in bf16 and fp32, the
  native kernel (radixkv/cpu/csrc/paged_decode.c) vs the torch reference backend's gather + SDPA;
- cascade decode: 32 requests in groups of 2, 4, 8 and 16 over shared prefixes of 64 to 1,024
  tokens (+64 own), cascade groups (radixkv/cpu/csrc/cascade.c) vs the plain kernel, in bf16
  (fp32 where the CPU lacks AVX512_BF16): where grouping starts to pay (radixkv/cpu/decode.py's
  thresholds come from these rows);
- prefill attention: a 1,024-token prompt, and 32 requests' 64 new tokens over 1,024 cached
  ones (an agent's questions after its system prompt), over 30 layers' paged KV, in bf16 and
  fp32 where the kernel takes them, the native kernel (radixkv/cpu/csrc/paged_extend.c) vs the
  torch reference's gather + SDPA;
- quantized linears (radixkv/cpu/csrc/quant_linear.c) on a Llama-3.2-1B's shapes (q, k/v,
  fused gate/up, down, lm_head) at 1, 8, 32 and 512 rows, q8_0 and q4_1 weights against the
  fp32 AVX2 kernel and F.linear: time, the weight's GB/s and its share of the read bandwidth
  measured in the same run (decode reads every weight once: that share is what it can gain).

    python -m radixkv.scenarios.cpu_kernels [--out out/cpu_kernels] [--repeats 5] [--layers 30] [--context 1032] [--quant-only]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from radixkv.attention.base import AttentionMetadata
from radixkv.attention.torch_backend import TorchBackend, extend_requests
from radixkv.cpu import decode as cpu_decode
from radixkv.cpu import extend as cpu_extend
from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.cpu.linear import PACK_FOR_ROWS, PackedLinear, available_linear_kernels, can_prepack
from radixkv.cpu.quant import QuantWeight, quantize_q8_0
from radixkv.cpu.quant_linear import QuantLinear, available_quant_kernels
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.plots import pyplot, save, save_results

LINEAR_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)
KV_HEADS, Q_HEADS, HEAD_DIM, PAGE_SIZE = 3, 9, 64, 16
BF16 = torch.bfloat16
# Llama-3.2-1B's linears as (out, in): q/o, k/v, the fused gate/up, down, the lm_head.
QUANT_SHAPES = {"q, o": (2048, 2048), "k, v": (512, 2048), "gate_up": (16384, 2048), "down": (2048, 8192), "lm_head": (128256, 2048)}


def coldest(run: Callable[[], object], repeats: int, flush: torch.Tensor) -> float:
    """Best of `repeats` seconds for run(), each after reading a buffer larger than the caches."""
    best = float("inf")
    for _ in range(repeats):
        flush.max()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def linear_rows(repeats: int, flush: torch.Tensor, layers: int, dtype: torch.dtype) -> list[dict]:
    """The native kernels for weights of `dtype` (at least one runs here) against torch's paths."""
    torch.manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in LINEAR_SHAPES.values()] + [LM_HEAD]
    weights = [torch.randn(n, k).to(dtype) for k, n in shapes]
    native_layers = {kernel: [PackedLinear(linear_module(w), kernel) for w in weights] for kernel in available_linear_kernels(dtype)}
    baseline = f"radixkv {available_linear_kernels(dtype)[0]}"
    prepacked = can_prepack(dtype, torch.device("cpu"))
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS) for w in weights] if prepacked else []
    rows = []
    for m in (1, 32, 512):
        used = len(shapes) if m <= 32 else len(shapes) - 1  # no lm_head over prefill rows
        inputs = [torch.randn(m, k).to(dtype) for k, _ in shapes[:used]]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights[:used])
        peers: dict[str, Callable[[], object]] = {
            f"radixkv {kernel}": (lambda layers=layers: [layer(x) for layer, x in zip(layers, inputs, strict=False)])
            for kernel, layers in native_layers.items()
        }
        if prepacked:
            peers["oneDNN prepacked"] = lambda: [
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w, x in zip(onednn, inputs, strict=False)
            ]
        peers["F.linear"] = lambda: [F.linear(x, w) for w, x in zip(weights, inputs, strict=False)]
        for run in peers.values():  # untimed: the first large allocations of a process fault pages in
            run()
        times = {name: coldest(run, repeats, flush) for name, run in peers.items()}
        for name, seconds in times.items():
            rows.append(dict(part=f"linears {str(dtype).removeprefix('torch.')}", case=f"{m} rows", peer=name, ms=seconds * 1e3,
                             gb_s=weight_bytes / seconds / 1e9, x_radixkv=seconds / times[baseline]))  # fmt: skip
    return rows


def linear_module(weight: torch.Tensor) -> torch.nn.Linear:
    """An nn.Linear (no bias) holding `weight`, for PackedLinear to pack."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return linear


def decode_rows(repeats: int, flush: torch.Tensor, layers: int, context: int, dtype: torch.dtype, num_seqs: int = 32) -> list[dict]:
    torch.manual_seed(0)
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq
    shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
    v_caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
    page_table = torch.randperm(num_pages, dtype=torch.int32).view(num_seqs, pages_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q = torch.randn(num_seqs, Q_HEADS, HEAD_DIM).to(dtype)
    backend = TorchBackend()
    meta = AttentionMetadata(
        positions=torch.full((num_seqs,), context - 1), slot_mapping=torch.full((num_seqs,), -1),
        page_table=page_table, cu_q_lens=torch.arange(num_seqs + 1, dtype=torch.int32),
        q_lens=torch.ones(num_seqs, dtype=torch.int32), seq_lens=seq_lens,
        prefix_lens=seq_lens - 1, max_q_len=1, max_seq_len=context, page_size=PAGE_SIZE,
        q_lens_list=[1] * num_seqs, seq_lens_list=[context] * num_seqs,
    )  # fmt: skip

    def gather_sdpa() -> None:
        backend.begin_step(meta, k_caches[0], Q_HEADS)  # once per step, as the model does
        for k, v in zip(k_caches, v_caches, strict=True):
            backend.decode(q, k, v, meta, HEAD_DIM**-0.5)

    peers = {
        "radixkv paged kernel": lambda: [
            cpu_decode.paged_decode(q, k, v, page_table, seq_lens, HEAD_DIM**-0.5) for k, v in zip(k_caches, v_caches, strict=True)
        ],
        "gather + SDPA": gather_sdpa,
    }
    kv_bytes = 2 * layers * num_seqs * context * KV_HEADS * HEAD_DIM * k_caches[0].element_size()
    times = {name: coldest(run, repeats, flush) for name, run in peers.items()}
    return [
        dict(part=f"decode attention {str(dtype).removeprefix('torch.')}", case=f"{num_seqs} x {context} tokens", peer=name, ms=seconds * 1e3,
             gb_s=kv_bytes / seconds / 1e9, x_radixkv=seconds / times["radixkv paged kernel"])  # fmt: skip
        for name, seconds in times.items()
    ]


def cascade_rows(repeats: int, flush: torch.Tensor, layers: int, dtype: torch.dtype, own: int = 64, num_seqs: int = 32) -> list[dict]:
    """Plain paged decode vs cascade groups (every group formed, whatever the thresholds say)."""
    rows = []
    for members in (2, 4, 8, 16):
        for shared in (64, 128, 256, 1024):
            torch.manual_seed(0)
            groups, shared_pages, own_pages = num_seqs // members, shared // PAGE_SIZE, -(-own // PAGE_SIZE)
            num_pages = groups * shared_pages + num_seqs * own_pages
            shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
            k_caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
            v_caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
            pages = torch.randperm(num_pages, dtype=torch.int32)
            prefixes = pages[: groups * shared_pages].view(groups, shared_pages)
            tails = pages[groups * shared_pages :].view(num_seqs, own_pages)
            page_table = torch.cat([prefixes.repeat_interleave(members, dim=0), tails], dim=1).contiguous()
            seq_lens = torch.full((num_seqs,), shared + own, dtype=torch.int32)
            q = torch.randn(num_seqs, Q_HEADS, HEAD_DIM).to(dtype)
            plan = cpu_decode.cascade_plan(page_table, seq_lens, PAGE_SIZE, min_shared_tokens=PAGE_SIZE, min_group_members=2).plan

            def run(plan=plan, k_caches=k_caches, v_caches=v_caches, page_table=page_table, seq_lens=seq_lens, q=q) -> None:
                for k, v in zip(k_caches, v_caches, strict=True):
                    cpu_decode.paged_decode(q, k, v, page_table, seq_lens, HEAD_DIM**-0.5, check=False, plan=plan)

            times = {
                "radixkv cascade": coldest(run, repeats, flush),
                "radixkv plain": coldest(lambda run=run: run(plan=None), repeats, flush),
            }
            unique_bytes = 2 * layers * num_pages * PAGE_SIZE * KV_HEADS * HEAD_DIM * dtype.itemsize
            rows += [
                dict(part=f"cascade decode {str(dtype).removeprefix('torch.')}", case=f"{members:>2} x {shared} shared", peer=name, ms=seconds * 1e3,
                     gb_s=unique_bytes / seconds / 1e9, x_radixkv=seconds / times["radixkv cascade"])  # fmt: skip
                for name, seconds in times.items()
            ]
    return rows


def extend_rows(repeats: int, flush: torch.Tensor, layers: int, dtype: torch.dtype) -> list[dict]:
    """Prefill attention: the native kernel vs the torch reference backend's per-request gather + SDPA."""
    rows = []
    for num_seqs, new, cached in ((1, 1024, 0), (32, 64, 1024)):
        torch.manual_seed(0)
        context = cached + new
        pages_per_seq = -(-context // PAGE_SIZE)
        shape = (num_seqs * pages_per_seq, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        k_caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
        v_caches = [torch.randn(shape).to(dtype) for _ in range(layers)]
        page_table = torch.randperm(shape[0], dtype=torch.int32).view(num_seqs, pages_per_seq)
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        q_starts = torch.arange(0, num_seqs * new, new, dtype=torch.int32)
        q_lens = torch.full((num_seqs,), new, dtype=torch.int32)
        q = torch.randn(num_seqs * new, Q_HEADS, HEAD_DIM).to(dtype)
        out = torch.empty_like(q)
        meta = AttentionMetadata(
            positions=torch.arange(cached, context).repeat(num_seqs), slot_mapping=torch.full((num_seqs * new,), -1),
            page_table=page_table, cu_q_lens=torch.arange(0, (num_seqs + 1) * new, new, dtype=torch.int32),
            q_lens=q_lens, seq_lens=seq_lens, prefix_lens=seq_lens - new, max_q_len=new, max_seq_len=context,
            page_size=PAGE_SIZE, q_lens_list=[new] * num_seqs, seq_lens_list=[context] * num_seqs,
        )  # fmt: skip

        def native_kernel() -> None:
            for k, v in zip(k_caches, v_caches, strict=True):
                cpu_extend.paged_extend(q, k, v, page_table, seq_lens, q_starts, q_lens, HEAD_DIM**-0.5, out)

        def gather_sdpa() -> None:
            for k, v in zip(k_caches, v_caches, strict=True):
                extend_requests(q, k, v, meta, HEAD_DIM**-0.5, out)

        times = {"radixkv prefill kernel": coldest(native_kernel, repeats, flush), "gather + SDPA": coldest(gather_sdpa, repeats, flush)}
        flops = 4 * layers * num_seqs * Q_HEADS * HEAD_DIM * new * (cached + (new + 1) / 2)
        rows += [
            dict(part=f"prefill attention {str(dtype).removeprefix('torch.')}", case=f"{num_seqs} x {new} new / {cached}", peer=name,
                 ms=seconds * 1e3, gflops=flops / seconds / 1e9, x_radixkv=seconds / times["radixkv prefill kernel"])  # fmt: skip
            for name, seconds in times.items()
        ]
    return rows


def random_q4_1(out_features: int, in_features: int) -> QuantWeight:
    """A q4_1 weight of random bytes (a kernel's speed does not depend on the values)."""
    blocks = (out_features, in_features // 32)
    return QuantWeight(
        "q4_1", out_features, in_features, torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8),
        (torch.rand(blocks) * 0.01).half(), (torch.rand(blocks) * -0.05).half(),
    )  # fmt: skip


def quant_rows(repeats: int, flush: torch.Tensor, read_gb_s: float) -> list[dict]:
    """Each quantized kernel that runs here, per format, against the fp32 AVX2 kernel and F.linear."""
    rows = []
    for name, (n, k) in QUANT_SHAPES.items():
        torch.manual_seed(0)
        weight = torch.randn(n, k) * 0.02
        layers: dict[str, torch.nn.Module] = {}
        for kernel in available_quant_kernels():
            layers[f"q8_0 {kernel}"] = QuantLinear(quantize_q8_0(weight), kernel=kernel)
            layers[f"q4_1 {kernel}"] = QuantLinear(random_q4_1(n, k), kernel=kernel)
        if "avx2" in available_linear_kernels(torch.float32):
            layers["fp32 avx2"] = PackedLinear(linear_module(weight), "avx2")
        baseline = next(iter(layers))
        for m in (1, 8, 32, 512):
            if name == "lm_head" and m > 32:
                continue  # prefill computes logits for its last token only
            x = torch.randn(m, k)
            peers: dict[str, tuple[Callable[[], object], int]] = {
                label: (lambda layer=layer: layer(x), getattr(layer, "weight_nbytes", n * k * 4)) for label, layer in layers.items()
            }
            peers["fp32 F.linear"] = (lambda: F.linear(x, weight), n * k * 4)
            for run, _ in peers.values():
                run()
            times = {label: coldest(run, repeats, flush) for label, (run, _) in peers.items()}
            for label, seconds in times.items():
                gb_s = peers[label][1] / seconds / 1e9
                rows.append(dict(part="quant linear", case=f"{name}, {m} rows", shape=f"{name} {n}x{k}", rows=m, peer=label, ms=seconds * 1e3, gb_s=gb_s,
                                 of_read_bw=gb_s / read_gb_s, x_radixkv=seconds / times[baseline]))  # fmt: skip
        del layers, weight
    return rows


def print_quant_rows(rows: list[dict]) -> None:
    print(f"\n{'quantized linear':<24} {'rows':>4} {'peer':<18} {'ms':>9} {'weight GB/s':>11} {'of read bw':>10} {'x first':>8}")
    print("-" * 90)
    for r in rows:
        print(f"{r['shape']:<24} {r['rows']:>4} {r['peer']:<18} {r['ms']:9.3f} {r['gb_s']:11.1f} {r['of_read_bw']:10.2f} {r['x_radixkv']:8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/cpu_kernels")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--context", type=int, default=1032, help="tokens of each decoding request")
    parser.add_argument("--flush-mib", type=int, default=1024, help="buffer read before each timing to empty the caches")
    parser.add_argument("--quant-only", action="store_true", help="only the quantized linears (with the machine's limits)")
    args = parser.parse_args(argv)
    library = native.load()
    if library is None:
        print("needs the native kernels (no C compiler here)")
        return 1
    flush = torch.ones(args.flush_mib << 20, dtype=torch.int8)
    if args.quant_only:
        limits = machine_limits(torch.float32)
        print(f"{limits['cpu']}, {limits['torch_threads']} threads: read {limits['read_bandwidth_gb_s']:.1f} GB/s (measured in this run)")
        rows = quant_rows(args.repeats, flush, limits["read_bandwidth_gb_s"])
        print_quant_rows(rows)
        save_results(args.out, "cpu_kernels_quant", dict(**limits, rows=rows), lambda path: _plot(rows, path))
        return 0
    rows = []
    for dtype in (BF16, torch.float32):
        if available_linear_kernels(dtype):
            rows += linear_rows(args.repeats, flush, args.layers, dtype)
    for dtype in (BF16, torch.float32):
        rows += decode_rows(args.repeats, flush, args.layers, args.context, dtype)
    # The shared items' tiles: bf16 on AVX512_BF16, fp32 on AVX-512 or AVX2; the dtype models load in.
    rows += cascade_rows(args.repeats, flush, args.layers, BF16 if cpu_features().avx512_bf16 else torch.float32)
    for dtype in (BF16, torch.float32):
        if cpu_extend.fits(dtype, HEAD_DIM, Q_HEADS // KV_HEADS):
            rows += extend_rows(args.repeats, flush, args.layers, dtype)
    matmul_dtype = BF16 if available_linear_kernels(BF16) else torch.float32  # the dtype models load in here
    limits = machine_limits(matmul_dtype)
    print(f"\n{limits['cpu']}, {limits['torch_threads']} threads: read {limits['read_bandwidth_gb_s']:.1f} GB/s, "
          f"{str(matmul_dtype).removeprefix('torch.')} matmul {limits['matmul_gflops']:.0f} GFLOP/s (measured in this run)")  # fmt: skip
    print(f"\n{'part':<26} {'case':<19} {'peer':<22} {'ms':>8} {'rate':>14} {'x radixkv':>9}")
    print("-" * 103)
    for r in rows:
        rate = f"{r['gflops']:7.1f} GFLOP/s" if "gflops" in r else f"{r['gb_s']:9.1f} GB/s"
        print(f"{r['part']:<26} {r['case']:<19} {r['peer']:<22} {r['ms']:8.2f} {rate:>14} {r['x_radixkv']:9.2f}")
    quant = quant_rows(args.repeats, flush, limits["read_bandwidth_gb_s"]) if available_quant_kernels() else []
    print_quant_rows(quant)
    save_results(args.out, "cpu_kernels", dict(**limits, rows=rows + quant), lambda path: _plot(rows, path))
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    cases = list(dict.fromkeys((r["part"], r["case"]) for r in rows))
    columns = min(6, len(cases))
    lines = -(-len(cases) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 4 * lines), squeeze=False)
    for ax in axes.flat[len(cases) :]:
        ax.axis("off")
    for ax, (part, case) in zip(axes.flat, cases):
        mine = [r for r in rows if (r["part"], r["case"]) == (part, case)]
        ax.bar([r["peer"] for r in mine], [r["ms"] for r in mine], color=["tab:blue"] + ["tab:gray"] * (len(mine) - 1))
        ax.set_title(f"{part}, {case} (ms)", fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle("CPU kernels vs the torch paths they replace (SmolLM2-135M shapes, cold caches)")
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
