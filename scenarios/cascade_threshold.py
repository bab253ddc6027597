"""Where a cascade group pays on this CPU, by the bytes of KV its members share: plain paged
decode against cascade groups (cpu_kernels.cascade_rows, caches cold) over 256 to 8,192 shared
tokens, for SmolLM2-135M's heads (9/3 of 64) and a 1B-class model's (32/8 of 64 and of 128).

The plan's threshold (radixkv/cpu/decode.py, min_shared_tokens) is a number of bytes per layer
against the CPU's caches, so the table lists each case's shared bytes beside the L2 and L3 sizes.

    python -m radixkv.scenarios.cascade_threshold [--out out/cascade_threshold] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from radixkv.cpu import decode as cpu_decode
from radixkv.cpu import native
from radixkv.cpu.features import CPUCaches, cpu_caches, cpu_features
from radixkv.scenarios.cpu_kernels import BF16, cascade_rows
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.plots import pyplot, save, save_results

HEADS = {"SmolLM2-135M": (9, 3, 64), "1B, head 64": (32, 8, 64), "8B, head 128": (32, 8, 128)}


def threshold_rows(args: argparse.Namespace, dtype: torch.dtype, flush: torch.Tensor) -> list[dict]:
    """One row per (model heads, members, shared tokens): plain ms over cascade ms."""
    rows = []
    for model, heads in HEADS.items():
        timed = cascade_rows(args.repeats, flush, args.layers, dtype, heads=heads, shared_lengths=tuple(args.shared),
                             group_sizes=tuple(args.members))  # fmt: skip
        for row in timed:
            if row["peer"] != "radixkv plain":
                continue
            _, kv_heads, head_dim = heads
            shared_bytes = 2 * row["shared"] * kv_heads * head_dim * dtype.itemsize
            planned = cpu_decode.min_shared_tokens(kv_heads, head_dim, dtype.itemsize)
            rows.append(dict(model=model, heads=row["heads"], members=row["members"], shared=row["shared"],
                             shared_kib_per_layer=shared_bytes / 1024, plain_over_cascade=row["x_radixkv"],
                             groups_now=row["shared"] >= planned and row["members"] >= cpu_decode.min_members(heads[0] // kv_heads)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/cascade_threshold")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="layers of KV per timing (each read cold)")
    parser.add_argument("--shared", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--flush-mib", type=int, default=512, help="buffer read before each timing to empty the caches")
    args = parser.parse_args(argv)
    if native.load() is None:
        print("needs the native kernels (no C compiler here)")
        return 1
    # The shared items' tiles run bf16 on AVX512_BF16, else fp32: the dtype models compute in.
    dtype = BF16 if cpu_features().avx512_bf16 else torch.float32
    flush = torch.ones(args.flush_mib << 20, dtype=torch.int8)
    rows = threshold_rows(args, dtype, flush)
    caches = cpu_caches()
    limits = machine_limits(dtype)
    print(f"\n{limits['cpu']}: L2 {caches.l2_bytes >> 10} KiB per core, L3 {caches.l3_bytes >> 10} KiB; read "
          f"{limits['read_bandwidth_gb_s']:.1f} GB/s, {str(dtype).removeprefix('torch.')} matmul {limits['matmul_gflops']:.0f} GFLOP/s (this run)")  # fmt: skip
    print(f"\n{'heads':<14} {'members':>7} {'shared':>7} {'KiB/layer':>10} {'plain/cascade':>13} {'grouped now':>11}")
    for r in rows:
        print(f"{r['heads']:<14} {r['members']:>7} {r['shared']:>7} {r['shared_kib_per_layer']:>10.0f} "
              f"{r['plain_over_cascade']:>13.2f} {'yes' if r['groups_now'] else 'no':>11}")  # fmt: skip
    results = dict(**limits, l2_bytes=caches.l2_bytes, l3_bytes=caches.l3_bytes, dtype=str(dtype), rows=rows)
    save_results(args.out, "cascade_threshold", results, lambda path: _plot(rows, caches, path))
    return 0


def _plot(rows: list[dict], caches: CPUCaches, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for heads, members in dict.fromkeys((r["heads"], r["members"]) for r in rows):
        mine = [r for r in rows if (r["heads"], r["members"]) == (heads, members)]
        ax.plot([r["shared_kib_per_layer"] for r in mine], [r["plain_over_cascade"] for r in mine], marker="o", label=f"{heads}, {members} members")
    for name, size in (("L2", caches.l2_bytes), ("L3", caches.l3_bytes)):
        if size:
            ax.axvline(size / 1024, color="gray", linestyle="--")
            ax.text(size / 1024, ax.get_ylim()[1], name, ha="right", va="top")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("shared KV per layer (KiB)")
    ax.set_ylabel("plain time / cascade time")
    ax.legend(fontsize=7)
    fig.suptitle("Where a cascade group pays: by the shared KV's bytes")
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
