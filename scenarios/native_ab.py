"""Two builds of the native library timed against each other in one process: the C sources of
the working tree and those of a git revision (default HEAD), compiled alike and run in turns on
the same inputs with cold caches, their outputs compared bit for bit. On a shared VM whose
speed moves 2x from one minute to the next, only such an A/B settles a change of 10-20%.

It times decode attention (radixkv/cpu/csrc/paged_decode*.c), SmolLM2-135M's shape over 30
layers of 32 requests x 1,032 tokens, in each dtype and with the requests' pages laid out three
ways: in order (one prompt's prefill), interleaved (as decode leaves them, a page per request
per 16 steps) and shuffled (a pool after hours of churn).

    python -m radixkv.scenarios.native_ab [--base HEAD] [--rounds 8] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from radixkv.cpu import decode as cpu_decode
from radixkv.cpu import native
from radixkv.scenarios.cpu_kernels import HEAD_DIM, KV_HEADS, PAGE_SIZE, Q_HEADS
from radixkv.scenarios.machine import machine_limits

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


def decode_ab(builds: dict, dtype: torch.dtype, order: str, args, flush: torch.Tensor) -> dict:
    """Decode attention under each build in turn, `rounds` times: best and median ms, and
    whether every build's output equals the first's bit for bit."""
    generator = torch.Generator().manual_seed(0)
    pages_per_seq = -(-args.context // PAGE_SIZE)
    shape = (args.num_seqs * pages_per_seq, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)) for _ in range(args.layers)]
    table = page_table(order, args.num_seqs, pages_per_seq, generator)
    seq_lens = torch.full((args.num_seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.num_seqs, Q_HEADS, HEAD_DIM, generator=generator).to(dtype)
    seconds: dict[str, list[float]] = {name: [] for name in builds}
    outputs = {}
    for turn in range(args.rounds):
        # Alternate who goes first: a VM slowing down mid-round does not favour either.
        for name, library in list(builds.items())[:: 1 if turn % 2 == 0 else -1]:
            with native.using(library):
                flush.max()
                start = time.perf_counter()
                for k, v in caches:
                    out = cpu_decode.paged_decode(q, k, v, table, seq_lens, HEAD_DIM**-0.5)
                seconds[name].append(time.perf_counter() - start)
            outputs[name] = out
    first = next(iter(builds))
    return dict(
        part=f"decode attention {str(dtype).removeprefix('torch.')}", case=order,
        best_ms={name: min(times) * 1e3 for name, times in seconds.items()},
        median_ms={name: statistics.median(times) * 1e3 for name, times in seconds.items()},
        identical=all(torch.equal(out, outputs[first]) for out in outputs.values()),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision whose sources are the baseline")
    parser.add_argument("--rounds", type=int, default=8, help="timed turns of each build")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--orders", default=",".join(ORDERS))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1032)
    parser.add_argument("--flush-mib", type=int, default=1024, help="buffer read before each timing to empty the caches")
    parser.add_argument("--out", default="out/native_ab")
    args = parser.parse_args(argv)
    compiler = native.find_compiler()
    if compiler is None:
        print("needs a C compiler")
        return 1
    with tempfile.TemporaryDirectory() as scratch:
        base = f"base ({args.base})"
        builds = {base: native.build_from(sources_at(args.base, Path(scratch)), compiler), "working tree": native.build_from(native.CSRC, compiler)}
    flush = torch.ones(args.flush_mib << 20, dtype=torch.int8)
    rows = [
        decode_ab(builds, getattr(torch, dtype), order, args, flush)
        for dtype in args.dtypes.split(",") for order in args.orders.split(",")
    ]  # fmt: skip
    limits = machine_limits(torch.float32)
    print(f"\n{limits['cpu']}, {limits['torch_threads']} threads: read {limits['read_bandwidth_gb_s']:.1f} GB/s (measured in this run)")
    print(f"{args.layers} layers of {args.num_seqs} x {args.context} tokens, best of {args.rounds} turns each, caches cold\n")
    print(f"{'part':<28} {'pages':<12} {base:>18} {'working tree':>14} {'tree / base':>12}  same bits")
    print("-" * 98)
    for row in rows:
        best = row["best_ms"]
        row["ratio"] = best["working tree"] / best[base]
        print(f"{row['part']:<28} {row['case']:<12} {best[base]:15.2f} ms {best['working tree']:11.2f} ms {row['ratio']:12.3f}  {row['identical']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "native_ab.json").write_text(json.dumps(dict(**limits, base=args.base, rounds=args.rounds, rows=rows), indent=2))
    _plot(rows, base, out / "native_ab.png")
    print(f"\nwrote {out / 'native_ab.json'} and {out / 'native_ab.png'}")
    return 0


def _plot(rows: list[dict], base: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{row['part'].removeprefix('decode attention ')}\n{row['case']}" for row in rows]
    ax.bar(range(len(rows)), [row["ratio"] for row in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(f"working tree / {base} (time)")
    ax.set_title("native library A/B, decode attention, caches cold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
