"""Kernel benchmark for one short GPU run: store_kv, extend and paged decode at serving sizes.

Measures this GPU's ceilings (device copy bandwidth, bf16 matmul rate), times each kernel with
triton.testing.do_bench in bf16, and prints achieved GB/s (decode, store) and TFLOP/s (extend)
as fractions of those ceilings, next to PyTorch SDPA over the already gathered KV; and cascade
decode (groups sharing a cached prefix read it once) against the same requests decoded apart.

    python -m radixkv.scenarios.triton_kernels --out out/kernel_bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

PAGE_SIZE = 16
DTYPE = torch.bfloat16
# A module constant so a CPU smoke run of the bench logic can swap it (with the interpreter).
DEVICE = "cuda"


@dataclass(frozen=True, slots=True)
class DecodeShape:
    num_seqs: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class ExtendShape:
    num_seqs: int
    prefix: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


DECODE_SHAPES = [
    DecodeShape(32, 16384, 32, 8, 128),
    DecodeShape(64, 4096, 32, 8, 128),
    DecodeShape(256, 1024, 32, 8, 128),
    DecodeShape(32, 8192, 16, 2, 128),
    DecodeShape(128, 4096, 8, 8, 64),
]
EXTEND_SHAPES = [
    ExtendShape(4, 0, 4096, 32, 8, 128),
    ExtendShape(32, 1024, 512, 32, 8, 128),
    ExtendShape(8, 8192, 1024, 32, 8, 128),
    ExtendShape(64, 2048, 64, 32, 8, 128),  # long prefix, short suffix: the weak case
    ExtendShape(16, 4096, 512, 16, 16, 64),
]
STORE_TOKENS = [(8192, 8, 128), (256, 8, 128)]


@dataclass(frozen=True, slots=True)
class CascadeShape:
    num_seqs: int
    num_groups: int  # requests split evenly; a group's members share its first `shared` tokens
    shared: int
    own: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


CASCADE_SHAPES = [
    CascadeShape(64, 4, 4096, 256, 32, 8, 128),  # agents: a few long system prompts
    CascadeShape(32, 1, 8192, 512, 32, 8, 128),  # one shared document, many questions
    CascadeShape(128, 8, 2048, 128, 9, 3, 64),  # SmolLM2-135M's heads
]


def _bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written) and dense bf16 matmul rate."""
    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, dtype=DTYPE, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    copy_ms = _bench_ms(lambda: dst.copy_(src))
    del src, dst
    size = 8192
    a = torch.randn(size, size, dtype=DTYPE, device=DEVICE)
    b = torch.randn(size, size, dtype=DTYPE, device=DEVICE)
    mm_ms = _bench_ms(lambda: a @ b)
    return {
        "copy_gbps": 2 * n * 2 / copy_ms / 1e6,
        "matmul_tflops": 2 * size**3 / mm_ms / 1e9,
    }


def _paged_cache(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Random KV for num_seqs sequences of seq_len tokens in shuffled pages, and their page table."""
    pages_per_seq = math.ceil(seq_len / PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    order = torch.randperm(num_pages, device=DEVICE).to(torch.int32)
    page_table = order.view(num_seqs, pages_per_seq).contiguous()
    return k_cache, v_cache, page_table


def _gather(cache: torch.Tensor, page_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, Hkv, seq_len, D] contiguous, as SDPA wants it."""
    b = page_table.shape[0]
    tokens = cache[page_table.long()].view(b, -1, *cache.shape[2:])[:, :seq_len]
    return tokens.transpose(1, 2).contiguous()


def _sdpa(q, k, v, **kwargs):
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def bench_decode(shape: DecodeShape, ceilings: dict[str, float]) -> dict:
    from radixkv.kernels import choose_num_splits, paged_decode

    b, ctx, hq, hkv, d = (shape.num_seqs, shape.context, shape.num_q_heads, shape.num_kv_heads,
                          shape.head_dim)
    k_cache, v_cache, page_table = _paged_cache(b, ctx, hkv, d, DTYPE)
    q = torch.randn(b, hq, d, dtype=DTYPE, device=DEVICE) * 2
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = paged_decode(q, k_cache, v_cache, seq_lens, page_table, ctx, scale)
    kernel_ms = _bench_ms(lambda: paged_decode(q, k_cache, v_cache, seq_lens, page_table, ctx, scale, out=out))
    keys, values = _gather(k_cache, page_table, ctx), _gather(v_cache, page_table, ctx)
    qs = q.unsqueeze(2)
    ref = _sdpa(qs, keys, values, scale=scale).squeeze(2)
    sdpa_ms = _bench_ms(lambda: _sdpa(qs, keys, values, scale=scale))
    bytes_moved = 2 * b * ctx * hkv * d * 2 + 2 * b * hq * d * 2
    del k_cache, v_cache, keys, values
    torch.cuda.empty_cache()
    gbps = bytes_moved / kernel_ms / 1e6
    sdpa_gbps = bytes_moved / sdpa_ms / 1e6
    return {
        **asdict(shape),
        "num_splits": choose_num_splits(b, hkv, ctx, q.device),
        "triton_ms": kernel_ms,
        "triton_gbps": gbps,
        "triton_frac_of_copy": gbps / ceilings["copy_gbps"],
        "sdpa_ms": sdpa_ms,
        "sdpa_gbps": sdpa_gbps,
        "sdpa_frac_of_copy": sdpa_gbps / ceilings["copy_gbps"],
        "max_rel_err_vs_sdpa": _rel_err(out, ref),
    }


def bench_extend(shape: ExtendShape, ceilings: dict[str, float]) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    from radixkv.kernels import extend_attention

    b, prefix, q_len = shape.num_seqs, shape.prefix, shape.q_len
    hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    seq_len = prefix + q_len
    k_cache, v_cache, page_table = _paged_cache(b, seq_len, hkv, d, DTYPE)
    keys, values = _gather(k_cache, page_table, seq_len), _gather(v_cache, page_table, seq_len)
    # The step's new tokens, [T, Hkv, D], equal to what store_kv put in the pages.
    k_new = keys[:, :, prefix:].transpose(1, 2).reshape(b * q_len, hkv, d).contiguous()
    v_new = values[:, :, prefix:].transpose(1, 2).reshape(b * q_len, hkv, d).contiguous()
    q = torch.randn(b * q_len, hq, d, dtype=DTYPE, device=DEVICE) * 2
    cu_q_lens = torch.arange(0, b + 1, dtype=torch.int32, device=DEVICE) * q_len
    seq_lens = torch.full((b,), seq_len, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5

    def run(out=None):
        return extend_attention(q, k_new, v_new, k_cache, v_cache, cu_q_lens, seq_lens, page_table,
                                q_len, scale, out=out)

    out = run()
    kernel_ms = _bench_ms(lambda: run(out))
    qs = q.view(b, q_len, hq, d).transpose(1, 2).contiguous()
    if prefix == 0:
        sdpa_kwargs = {"is_causal": True, "scale": scale}
    else:
        sdpa_kwargs = {"attn_mask": causal_lower_right(q_len, seq_len), "scale": scale}
    ref = _sdpa(qs, keys, values, **sdpa_kwargs)
    sdpa_ms = _bench_ms(lambda: _sdpa(qs, keys, values, **sdpa_kwargs))
    flops = 4 * b * hq * d * (q_len * prefix + q_len * (q_len + 1) / 2)
    del k_cache, v_cache, keys, values
    torch.cuda.empty_cache()
    tflops = flops / kernel_ms / 1e9
    sdpa_tflops = flops / sdpa_ms / 1e9
    return {
        **asdict(shape),
        "triton_ms": kernel_ms,
        "triton_tflops": tflops,
        "triton_frac_of_matmul": tflops / ceilings["matmul_tflops"],
        "sdpa_ms": sdpa_ms,
        "sdpa_tflops": sdpa_tflops,
        "sdpa_frac_of_matmul": sdpa_tflops / ceilings["matmul_tflops"],
        "max_rel_err_vs_sdpa": _rel_err(out.view(b, q_len, hq, d).transpose(1, 2), ref),
    }


def bench_store(num_tokens: int, num_kv_heads: int, head_dim: int, ceilings: dict[str, float]) -> dict:
    from radixkv.kernels import store_kv

    num_pages = 4 * math.ceil(num_tokens / PAGE_SIZE)
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    slots = torch.randperm(num_pages * PAGE_SIZE, device=DEVICE)[:num_tokens]
    ms = _bench_ms(lambda: store_kv(k, v, k_cache, v_cache, slots))
    ref_ms = _bench_ms(lambda: (k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k),
                                v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)))
    bytes_moved = 2 * 2 * num_tokens * num_kv_heads * head_dim * 2
    gbps = bytes_moved / ms / 1e6
    return {
        "num_tokens": num_tokens,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "triton_ms": ms,
        "triton_gbps": gbps,
        "triton_frac_of_copy": gbps / ceilings["copy_gbps"],
        "index_copy_ms": ref_ms,
    }


def bench_cascade(shape: CascadeShape, ceilings: dict[str, float]) -> dict:
    """The same decode with and without cascade groups: time, bytes each must read, agreement."""
    from radixkv.kernels import CascadeGroups, paged_decode

    b, g, hq, hkv, d = shape.num_seqs, shape.num_groups, shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    assert b % g == 0 and shape.shared % PAGE_SIZE == 0
    seq_len = shape.shared + shape.own
    shared_pages, own_pages = shape.shared // PAGE_SIZE, math.ceil(shape.own / PAGE_SIZE)
    num_pages = g * shared_pages + b * own_pages
    cache_shape = (num_pages, PAGE_SIZE, hkv, d)
    k_cache = torch.randn(cache_shape, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn(cache_shape, dtype=DTYPE, device=DEVICE)
    order = torch.randperm(num_pages, device=DEVICE).to(torch.int32)
    shared = order[: g * shared_pages].view(g, shared_pages)
    own = order[g * shared_pages :].view(b, own_pages)
    members_per_group = b // g
    group_of = torch.arange(b, device=DEVICE) // members_per_group
    page_table = torch.cat([shared[group_of], own], dim=1).contiguous()
    groups = CascadeGroups(
        group_start=(torch.arange(g + 1, device=DEVICE) * members_per_group).to(torch.int32),
        members=torch.arange(b, device=DEVICE, dtype=torch.int32),
        shared_len=torch.full((g,), shape.shared, dtype=torch.int32, device=DEVICE),
        own_begin=torch.full((b,), shape.shared, dtype=torch.int32, device=DEVICE),
        max_shared_len=shape.shared,
        max_members=members_per_group,
    )
    q = torch.randn(b, hq, d, dtype=DTYPE, device=DEVICE) * 2
    seq_lens = torch.full((b,), seq_len, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    apart = paged_decode(q, k_cache, v_cache, seq_lens, page_table, seq_len, scale)
    together = paged_decode(q, k_cache, v_cache, seq_lens, page_table, seq_len, scale, groups=groups)
    apart_ms = _bench_ms(lambda: paged_decode(q, k_cache, v_cache, seq_lens, page_table, seq_len, scale, out=apart))
    cascade_ms = _bench_ms(
        lambda: paged_decode(q, k_cache, v_cache, seq_lens, page_table, seq_len, scale, out=together, groups=groups)
    )
    token_bytes = 2 * hkv * d * 2  # K and V of one token
    cascade_bytes = (g * shape.shared + b * shape.own) * token_bytes
    apart_bytes = b * seq_len * token_bytes
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return {
        **asdict(shape),
        "apart_ms": apart_ms,
        "cascade_ms": cascade_ms,
        "speedup": apart_ms / cascade_ms,
        "bytes_ratio": apart_bytes / cascade_bytes,
        # Each kernel against the bytes it must read, at the copy rate.
        "apart_frac_of_copy": apart_bytes / apart_ms / 1e6 / ceilings["copy_gbps"],
        "cascade_frac_of_copy": cascade_bytes / cascade_ms / 1e6 / ceilings["copy_gbps"],
        "max_rel_err_cascade_vs_apart": _rel_err(together, apart),
    }


def check_against_torch_backend() -> list[dict]:
    """Small ragged cases (uneven lengths, GQA 4, page size 16) vs the torch reference backend in fp32."""
    from dataclasses import replace

    from radixkv.attention.base import AttentionMetadata
    from radixkv.attention.torch_backend import TorchBackend
    from radixkv.attention.triton_backend import TritonBackend

    results = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        for prefix_lens, q_lens in (([0, 300, 1500, 17], [200, 1, 33, 64]), ([700, 2, 90], [1, 1, 1])):
            hq, hkv, d = 16, 4, 128
            seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
            pages = [math.ceil(s / PAGE_SIZE) for s in seq_lens]
            num_pages = sum(pages) + 2
            order = torch.randperm(num_pages)
            table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
            slots, used = [], 0
            for i, n in enumerate(pages):
                table[i, :n] = order[used : used + n].to(torch.int32)
                used += n
                pos = torch.arange(prefix_lens[i], seq_lens[i])
                slots.append(table[i, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE)
            k_cache = torch.randn(num_pages, PAGE_SIZE, hkv, d, device=DEVICE).to(dtype)
            v_cache = torch.randn_like(k_cache)
            t = sum(q_lens)
            q = (torch.randn(t, hq, d, device=DEVICE) * 3).to(dtype)
            k = torch.randn(t, hkv, d, device=DEVICE).to(dtype)
            v = torch.randn(t, hkv, d, device=DEVICE).to(dtype)
            cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(q_lens).cumsum(0)
            meta = AttentionMetadata(
                positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)]).to(DEVICE),
                slot_mapping=torch.cat(slots).to(DEVICE),
                page_table=table.to(DEVICE),
                cu_q_lens=cu.to(DEVICE),
                q_lens=torch.tensor(q_lens, dtype=torch.int32).to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
                prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32).to(DEVICE),
                max_q_len=max(q_lens),
                max_seq_len=max(seq_lens),
                page_size=PAGE_SIZE,
                q_lens_list=q_lens,
                seq_lens_list=seq_lens,
            )
            scale = d**-0.5
            kc, vc = k_cache.clone(), v_cache.clone()
            triton, reference = TritonBackend(check_indices=True), TorchBackend()
            out = triton.forward(q, k, v, kc, vc, triton.begin_step(replace(meta), kc, hq), scale)
            rk, rv = k_cache.float(), v_cache.float()
            ref = reference.forward(q.float(), k.float(), v.float(), rk, rv, reference.begin_step(replace(meta), rk, hq), scale)
            err = _rel_err(out, ref)
            store_ok = torch.equal(kc.float(), rk) and torch.equal(vc.float(), rv)
            results.append({
                "dtype": str(dtype).removeprefix("torch."),
                "kind": "decode" if meta.is_decode_only else "extend",
                "max_rel_err": err,
                "tolerance": tol,
                "store_kv_exact": store_ok,
                "ok": bool(err <= tol and store_ok and torch.isfinite(out).all()),
            })
    return results


def _section(header: str, cases, bench, row) -> list[dict]:
    """Bench each case, printing the header and then a row per case as it completes."""
    print(f"\n{header}")
    results = []
    for case in cases:
        results.append(bench(case))
        print(row(results[-1]))
    return results


def _decode_row(r: dict) -> str:
    return (f"B={r['num_seqs']:<4} ctx={r['context']:<6} H={r['num_q_heads']}/{r['num_kv_heads']} D={r['head_dim']:<4}"
            f" {r['num_splits']:>3} {r['triton_ms']:>9.3f} {r['triton_gbps']:>6.0f} {r['triton_frac_of_copy']:>7.0%}"
            f" | {r['sdpa_ms']:>7.3f} {r['sdpa_gbps']:>6.0f} {r['sdpa_frac_of_copy']:>7.0%} | {r['max_rel_err_vs_sdpa']:.1e}")


def _extend_row(r: dict) -> str:
    return (f"B={r['num_seqs']:<3} prefix={r['prefix']:<5} q={r['q_len']:<5} H={r['num_q_heads']}/{r['num_kv_heads']}"
            f" D={r['head_dim']:<4} {r['triton_ms']:>8.3f} {r['triton_tflops']:>7.0f} {r['triton_frac_of_matmul']:>5.0%}"
            f" | {r['sdpa_ms']:>7.3f} {r['sdpa_tflops']:>7.0f} {r['sdpa_frac_of_matmul']:>5.0%} | {r['max_rel_err_vs_sdpa']:.1e}")


def _cascade_row(r: dict) -> str:
    return (f"B={r['num_seqs']:<4} groups={r['num_groups']:<2} shared={r['shared']:<5} own={r['own']:<4}"
            f" H={r['num_q_heads']}/{r['num_kv_heads']} D={r['head_dim']:<4}"
            f" {r['apart_ms']:>8.3f} {r['cascade_ms']:>10.3f} {r['speedup']:>8.2f}x {r['bytes_ratio']:>6.1f}x"
            f" {r['apart_frac_of_copy']:>5.0%}/{r['cascade_frac_of_copy']:<5.0%} | {r['max_rel_err_cascade_vs_apart']:.1e}")


def _store_row(r: dict) -> str:
    return (f"T={r['num_tokens']:<6} Hkv={r['num_kv_heads']} D={r['head_dim']:<4} {r['triton_ms']:>12.4f}"
            f" {r['triton_gbps']:>6.0f} {r['triton_frac_of_copy']:>7.0%} | {r['index_copy_ms']:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/kernel_bench.json", help="where to write the JSON results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("scenarios/triton_kernels.py: no CUDA device found; this benchmark needs a GPU. Nothing was measured.")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("scenarios/triton_kernels.py: TRITON_INTERPRET is set; timing the interpreter means nothing. Unset it.")
        return 0

    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    checks = check_against_torch_backend()
    for c in checks:
        print(f"check {c['kind']:6} {c['dtype']:8} rel err {c['max_rel_err']:.2e} (tol {c['tolerance']:.0e})"
              f" store exact {c['store_kv_exact']}  {'ok' if c['ok'] else 'FAILED'}")
    ceilings = measure_ceilings()
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")

    decode = _section(
        "decode (bf16, page 16)        splits  triton ms   GB/s  of copy | sdpa ms   GB/s  of copy | rel err",
        DECODE_SHAPES, lambda shape: bench_decode(shape, ceilings), _decode_row,
    )  # fmt: skip
    extend = _section(
        "extend (bf16, page 16)                  triton ms  TFLOP/s of mm | sdpa ms  TFLOP/s of mm | rel err",
        EXTEND_SHAPES, lambda shape: bench_extend(shape, ceilings), _extend_row,
    )  # fmt: skip
    cascade = _section(
        "cascade decode (bf16, page 16)            apart ms  cascade ms  speed-up  bytes /  of copy a/c | rel err",
        CASCADE_SHAPES, lambda shape: bench_cascade(shape, ceilings), _cascade_row,
    )  # fmt: skip
    store = _section(
        "store_kv (bf16)            triton ms   GB/s  of copy | index_copy ms",
        STORE_TOKENS, lambda case: bench_store(*case, ceilings), _store_row,
    )  # fmt: skip

    result = {
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "page_size": PAGE_SIZE,
        "ceilings": ceilings,
        "checks": checks,
        "decode": decode,
        "extend": extend,
        "cascade_decode": cascade,
        "store_kv": store,
        "wall_s": time.perf_counter() - started,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out} in {result['wall_s']:.0f} s")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
