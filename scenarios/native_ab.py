"""Two builds of the native library timed against each other in one process: the C sources of
the working tree and those of a git revision (default HEAD), compiled alike and run in turns on
the same inputs with cold caches, their outputs compared bit for bit. On a shared VM whose
speed moves 2x from one minute to the next, only such an A/B settles a change of 10-20%.

On SmolLM2-135M's shapes over 30 layers it times:
- decode attention (radixkv/cpu/csrc/paged_decode*.c), 32 requests x 1,032 tokens, in each
  dtype, with the requests' pages laid out three ways: in order (one prompt's prefill),
  interleaved (as decode leaves them, a page per request per 16 steps) and shuffled (a pool
  after hours of churn);
- the packed linears (packed_linear.c, linear_f32.c) of each dtype with a native kernel here,
  at 1 and 32 rows (decode's, with the lm_head) and 512 (prefill's), each build packing its own
  weights;
- prefill attention (paged_extend.c) in each dtype it takes here: a 1,024-token prompt, and 32
  requests' 64 new tokens over 1,024 cached ones;
- with --parts cascade, decode attention of 16 requests over a --shared-prefix of cached
  tokens (+64 own) in one cascade group (cascade.c): no plan, the batch-invariant plan (whose
  outputs must equal no plan's, bit for bit, in each build) and the tiles' plan.

    python -m radixkv.scenarios.native_ab [--base HEAD] [--rounds 12] [--parts decode,linears,prefill,cascade]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from radixkv.cpu import decode as cpu_decode
from radixkv.cpu import extend as cpu_extend
from radixkv.cpu import native
from radixkv.cpu.linear import PackedLinear, available_linear_kernels
from radixkv.scenarios.cpu_kernels import HEAD_DIM, KV_HEADS, LINEAR_SHAPES, LM_HEAD, PAGE_SIZE, Q_HEADS, linear_module
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.plots import pyplot, save, save_results

ORDERS = ("in_order", "interleaved", "shuffled")
REPO = Path(__file__).resolve().parents[1]


def sources_at(revision: str, into: Path) -> Path:
    """The native sources as they were at `revision` of this repository, written under `into`."""
    relative = native.CSRC.relative_to(REPO)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, str(relative)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / relative


def page_table(order: str, num_seqs: int, pages_per_seq: int, generator: torch.Generator) -> torch.Tensor:
    """Each request's pages: consecutive, interleaved with the batch's, or anywhere in the pool."""
    pages = torch.arange(num_seqs * pages_per_seq, dtype=torch.int32)
    if order == "interleaved":
        return pages.view(pages_per_seq, num_seqs).t().contiguous()
    if order == "shuffled":
        pages = pages[torch.randperm(pages.numel(), generator=generator)]
    return pages.view(num_seqs, pages_per_seq)


def kv_caches(num_pages: int, dtype: torch.dtype, layers: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V pools of random values, SmolLM2's kv heads and head_dim."""
    shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)) for _ in range(layers)]


def decode_ab(builds: dict, dtype: torch.dtype, order: str, args, flush: torch.Tensor) -> dict:
    """Decode attention over every layer's KV, under each build in turn."""
    generator = torch.Generator().manual_seed(0)
    pages_per_seq = -(-args.context // PAGE_SIZE)
    caches = kv_caches(args.num_seqs * pages_per_seq, dtype, args.layers, generator)
    table = page_table(order, args.num_seqs, pages_per_seq, generator)
    seq_lens = torch.full((args.num_seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.num_seqs, Q_HEADS, HEAD_DIM, generator=generator).to(dtype)
    runs = {name: (lambda: [cpu_decode.paged_decode(q, k, v, table, seq_lens, HEAD_DIM**-0.5) for k, v in caches]) for name in builds}
    return in_turns(builds, runs, args.rounds, flush) | dict(part=f"decode attention {_name(dtype)}", case=order)


def linears_ab(builds: dict, dtype: torch.dtype, rows: int, args, flush: torch.Tensor) -> dict:
    """The native linears of `dtype` over every layer's shapes (and the lm_head at decode's rows),
    under each build in turn, each with the weights it packed itself."""
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(args.layers) for shape in LINEAR_SHAPES.values()] + ([LM_HEAD] if rows <= 32 else [])
    weights = [torch.randn(n, k, generator=generator).to(dtype) for k, n in shapes]
    inputs = [torch.randn(rows, k, generator=generator).to(dtype) for k, _ in shapes]
    runs = {}
    for name, library in builds.items():
        with native.using(library):
            kernel = available_linear_kernels(dtype)[0]
            layers = [PackedLinear(linear_module(weight), kernel) for weight in weights]
        runs[name] = lambda layers=layers: [layer(x) for layer, x in zip(layers, inputs, strict=True)]
    return in_turns(builds, runs, args.rounds, flush) | dict(part=f"linears {_name(dtype)} ({kernel})", case=f"{rows} rows")


def prefill_ab(builds: dict, dtype: torch.dtype, num_seqs: int, new: int, cached: int, args, flush: torch.Tensor) -> dict:
    """Prefill attention of `new` tokens a request over `cached` ones in its pages, shuffled over
    the pool, under each build in turn."""
    generator = torch.Generator().manual_seed(0)
    context = cached + new
    pages_per_seq = -(-context // PAGE_SIZE)
    caches = kv_caches(num_seqs * pages_per_seq, dtype, args.layers, generator)
    table = page_table("shuffled", num_seqs, pages_per_seq, generator)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q_starts = torch.arange(0, num_seqs * new, new, dtype=torch.int32)
    q_lens = torch.full((num_seqs,), new, dtype=torch.int32)
    q = torch.randn(num_seqs * new, Q_HEADS, HEAD_DIM, generator=generator).to(dtype)

    def run() -> list[torch.Tensor]:
        outs = [torch.empty_like(q) for _ in caches]
        for (k, v), out in zip(caches, outs, strict=True):
            cpu_extend.paged_extend(q, k, v, table, seq_lens, q_starts, q_lens, HEAD_DIM**-0.5, out)
        return outs

    result = in_turns(builds, {name: run for name in builds}, args.rounds, flush)
    return result | dict(part=f"prefill attention {_name(dtype)}", case=f"{num_seqs} x {new} new / {cached}")


CASCADE_MEMBERS, CASCADE_OWN_TOKENS = 16, 64


def cascade_ab(builds: dict, dtype: torch.dtype, plan_kind: str, args, flush: torch.Tensor) -> dict:
    """Decode attention of CASCADE_MEMBERS requests whose first --shared-prefix tokens are the
    same pages, over every layer's KV, with no plan, the batch-invariant plan or the tiles'
    plan, under each build in turn."""
    generator = torch.Generator().manual_seed(0)
    shared, own = args.shared_prefix // PAGE_SIZE, -(-CASCADE_OWN_TOKENS // PAGE_SIZE)
    caches = kv_caches(shared + CASCADE_MEMBERS * own, dtype, args.layers, generator)
    table = torch.empty(CASCADE_MEMBERS, shared + own, dtype=torch.int32)
    table[:, :shared] = torch.arange(shared, dtype=torch.int32)
    table[:, shared:] = shared + torch.arange(CASCADE_MEMBERS * own, dtype=torch.int32).view(CASCADE_MEMBERS, own)
    seq_lens = torch.full((CASCADE_MEMBERS,), shared * PAGE_SIZE + CASCADE_OWN_TOKENS, dtype=torch.int32)
    q = torch.randn(CASCADE_MEMBERS, Q_HEADS, HEAD_DIM, generator=generator).to(dtype)

    def run(plan: torch.Tensor | None) -> list[torch.Tensor]:
        return [cpu_decode.paged_decode(q, k, v, table, seq_lens, HEAD_DIM**-0.5, plan=plan) for k, v in caches]

    runs = {}
    for name, library in builds.items():
        with native.using(library):
            plan = cpu_decode.cascade_plan(table, seq_lens, PAGE_SIZE, min_shared_tokens=PAGE_SIZE)
            plan = {"none": None, "exact": cpu_decode.batch_invariant_plan(plan, CASCADE_MEMBERS).plan, "tiles": plan.plan}[plan_kind]
            if plan_kind == "exact" and not all(map(torch.equal, run(plan), run(None))):
                raise AssertionError(f"{name}: the batch-invariant plan's outputs differ from no plan's")
        runs[name] = lambda plan=plan: run(plan)
    result = in_turns(builds, runs, args.rounds, flush)
    return result | dict(part=f"cascade {_name(dtype)}", case=f"{plan_kind} plan")


def in_turns(builds: dict, runs: dict, rounds: int, flush: torch.Tensor) -> dict:
    """Each build's run (a list of output tensors), `rounds` times in turns, caches emptied before
    each: best and median ms, and whether every build's outputs equal the first's bit for bit."""
    seconds: dict[str, list[float]] = {name: [] for name in builds}
    outputs = {}
    for turn in range(rounds):
        # Alternate who goes first: a VM slowing down mid-round does not favour either.
        for name, library in list(builds.items())[:: 1 if turn % 2 == 0 else -1]:
            with native.using(library):
                if flush.numel():  # --flush-mib 0 times warm caches
                    flush.max()
                start = time.perf_counter()
                outputs[name] = runs[name]()
                seconds[name].append(time.perf_counter() - start)
    first = next(iter(builds))
    return dict(
        best_ms={name: min(times) * 1e3 for name, times in seconds.items()},
        median_ms={name: statistics.median(times) * 1e3 for name, times in seconds.items()},
        identical=all(all(map(torch.equal, out, outputs[first])) for out in outputs.values()),
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision whose sources are the baseline")
    parser.add_argument("--rounds", type=int, default=12, help="timed turns of each build (identical builds: within 2%% at 16)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--orders", default=",".join(ORDERS), help="decode's page layouts")
    parser.add_argument("--parts", default="decode,linears,prefill")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1032, help="decode's tokens a request")
    parser.add_argument("--prefill-len", type=int, default=1024, help="prefill's prompt, and its cached tokens a request")
    parser.add_argument("--shared-prefix", type=int, default=4096, help="cascade's shared tokens (a multiple of 256)")
    parser.add_argument("--flush-mib", type=int, default=1024, help="buffer read before each timing to empty the caches")
    parser.add_argument("--out", default="out/native_ab")
    args = parser.parse_args(argv)
    compiler = native.find_compiler()
    if compiler is None:
        print("needs a C compiler")
        return 1
    base = f"base ({args.base})"
    with tempfile.TemporaryDirectory() as scratch:
        try:
            builds = {base: native.build_from(sources_at(args.base, Path(scratch)), compiler), "working tree": native.build_from(native.CSRC, compiler)}
        except subprocess.CalledProcessError as error:
            detail = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
            print(f"{' '.join(map(str, error.cmd[:3]))} ... failed: {detail.strip()[-2000:]}")
            return 2
    flush = torch.ones(args.flush_mib << 20, dtype=torch.int8)
    dtypes, parts = [getattr(torch, name) for name in args.dtypes.split(",")], args.parts.split(",")
    rows = []
    if "decode" in parts:
        rows += [decode_ab(builds, dtype, order, args, flush) for dtype in dtypes for order in args.orders.split(",")]
    if "linears" in parts:
        with native.using(builds["working tree"]):
            linear_dtypes = [dtype for dtype in dtypes if available_linear_kernels(dtype)]
        rows += [linears_ab(builds, dtype, count, args, flush) for dtype in linear_dtypes for count in (1, 32, 512)]
    if "prefill" in parts:
        with native.using(builds["working tree"]):
            prefill_dtypes = [dtype for dtype in dtypes if cpu_extend.fits(dtype, HEAD_DIM, Q_HEADS // KV_HEADS)]
        shapes = [(1, args.prefill_len, 0), (args.num_seqs, 64, args.prefill_len)]
        rows += [prefill_ab(builds, dtype, *shape, args, flush) for dtype in prefill_dtypes for shape in shapes]
    if "cascade" in parts:
        rows += [cascade_ab(builds, dtype, kind, args, flush) for dtype in dtypes for kind in ("none", "exact", "tiles")]
    limits = machine_limits(torch.float32)
    print(f"\n{limits['cpu']}, {limits['torch_threads']} threads: read {limits['read_bandwidth_gb_s']:.1f} GB/s (measured in this run)")
    print(f"{args.layers} layers (decode: {args.num_seqs} x {args.context} tokens), best of {args.rounds} turns each, caches cold\n")
    print(f"{'part':<28} {'case':<12} {base:>18} {'working tree':>14} {'tree / base':>12}  same bits")
    print("-" * 98)
    for row in rows:
        best = row["best_ms"]
        row["ratio"] = best["working tree"] / best[base]
        print(f"{row['part']:<28} {row['case']:<12} {best[base]:15.2f} ms {best['working tree']:11.2f} ms {row['ratio']:12.3f}  {row['identical']}")
    results = dict(**limits, base=args.base, rounds=args.rounds, rows=rows)
    save_results(args.out, "native_ab", results, lambda path: _plot(rows, base, path))
    return 0


def _plot(rows: list[dict], base: str, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows)), 3.8))
    labels = [f"{row['part']}\n{row['case']}".replace("decode attention", "decode") for row in rows]
    ax.bar(range(len(rows)), [row["ratio"] for row in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(f"working tree / {base} (time)")
    ax.set_title("native library A/B, caches cold")
    save(fig, path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
