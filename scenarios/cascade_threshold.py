"""Where a cascade group pays on this CPU, by the bytes of KV its members share: plain paged
decode against cascade groups (cpu_kernels.cascade_rows, caches cold) over 256 to 8,192 shared
tokens, for SmolLM2-135M's heads (9/3 of 64) and a 1B-class model's (32/8 of 64 and of 128).

The plan's threshold (radixkv/cpu/decode.py, cascade_thresholds) is the bytes a group saves
reading, (members - 1) x one layer's shared K and V, against a core's L2, so the table lists each
case's saved bytes beside the L2 and L3 sizes.

    python -m radixkv.scenarios.cascade_threshold [--out out/cascade_threshold] [--layers 4] [--repeats 3]
    python -m radixkv.scenarios.cascade_threshold --ab [--members 16] [--shared 0 512 1024 4096 8192] [--rounds 8]

--ab: cascade off, on (every group formed), auto (the default thresholds), on without the tiles
and bi (auto's groups as a batch-invariant step runs them: cut to the 256-key chunk grid, each
member through the plain kernel) alternated in turns in one process, one group of --members
requests over each shared length with the default model's heads, and the ratios to off.
"""

from __future__ import annotations

import argparse
import time
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
            auto = cpu_decode.cascade_thresholds(heads[0], kv_heads, head_dim, dtype.itemsize)
            rows.append(dict(model=model, heads=row["heads"], members=row["members"], shared=row["shared"],
                             shared_kib_per_layer=shared_bytes / 1024, saved_kib_per_layer=(row["members"] - 1) * shared_bytes / 1024,
                             plain_over_cascade=row["x_radixkv"], groups_now=groups(auto, row["members"], row["shared"])))  # fmt: skip
    return rows


def groups(thresholds: dict[str, int], members: int, shared: int) -> bool:
    """Whether the plan's thresholds group `members` requests over `shared` tokens."""
    return (members >= thresholds["min_group_members"] and shared >= thresholds["min_shared_tokens"]
            and (members - 1) * shared >= thresholds["min_saved_tokens"])  # fmt: skip


def ab_rows(args: argparse.Namespace, dtype: torch.dtype, flush: torch.Tensor) -> list[dict]:
    """One row per (members, shared tokens): cascade off, on, auto and on without the tiles
    alternated in turns (the order rotating each round), each timing over --layers layers of
    KV read cold; best ms."""
    q_heads, kv_heads, head_dim = HEADS["SmolLM2-135M"]
    auto = cpu_decode.cascade_thresholds(q_heads, kv_heads, head_dim, dtype.itemsize)
    page, own, rows = 16, 64, []
    for members in args.members:
        for shared in args.shared:
            torch.manual_seed(0)
            shared_pages, own_pages = shared // page, own // page
            num_pages = shared_pages + members * own_pages
            shape = (num_pages, page, kv_heads, head_dim)
            caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
            pages = torch.randperm(num_pages, dtype=torch.int32)
            prefix = pages[:shared_pages].view(1, shared_pages).repeat(members, 1)
            page_table = torch.cat([prefix, pages[shared_pages:].view(members, own_pages)], dim=1).contiguous()
            seq_lens = torch.full((members,), shared + own, dtype=torch.int32)
            q = torch.randn(members, q_heads, head_dim).to(dtype)
            any_group = dict(min_shared_tokens=page, min_group_members=2)
            on = cpu_decode.cascade_plan(page_table, seq_lens, page, **any_group).plan
            # "members": the groups of "on" with the tiles off (EngineConfig.cascade_tiles=False);
            # "bi": auto's groups as a batch-invariant step runs them (cpu_decode.batch_invariant_plan).
            auto_plan = cpu_decode.cascade_plan(page_table, seq_lens, page, **auto)
            bi = cpu_decode.batch_invariant_plan(auto_plan, members).plan
            plans = {"off": None, "on": on, "auto": auto_plan.plan, "members": on, "bi": bi}
            times: dict[str, list[float]] = {mode: [] for mode in plans}
            for r in range(-1, args.rounds):  # round -1 warms up, untimed
                modes = list(plans)[r % len(plans) :] + list(plans)[: r % len(plans)]
                for mode in modes:
                    cpu_decode.use_cascade_tiles(mode != "members")
                    flush.max()
                    start = time.perf_counter()
                    for k, v in caches:
                        cpu_decode.paged_decode(q, k, v, page_table, seq_lens, head_dim**-0.5, check=False, plan=plans[mode])
                    if r >= 0:
                        times[mode].append((time.perf_counter() - start) / args.layers)
            cpu_decode.use_cascade_tiles(True)
            # Best of the rounds: on a shared machine the other loads only ever add time.
            ms = {mode: min(t) * 1e3 for mode, t in times.items()}
            saved_kib = (members - 1) * 2 * shared * kv_heads * head_dim * dtype.itemsize / 1024
            rows.append(dict(members=members, shared=shared, saved_kib_per_layer=saved_kib, auto_groups=plans["auto"] is not None,
                             off_ms=ms["off"], on_ms=ms["on"], auto_ms=ms["auto"], no_tiles_ms=ms["members"],
                             off_over_on=ms["off"] / ms["on"], off_over_auto=ms["off"] / ms["auto"],
                             off_over_no_tiles=ms["off"] / ms["members"], bi_ms=ms["bi"], off_over_bi=ms["off"] / ms["bi"]))  # fmt: skip
            print(f"{members:>7} {shared:>7} {saved_kib:>10.0f} {ms['off']:>8.3f} {ms['on']:>8.3f} {ms['auto']:>8.3f} "
                  f"{ms['off'] / ms['on']:>7.2f} {ms['off'] / ms['auto']:>8.2f} {ms['off'] / ms['members']:>13.2f} "
                  f"{ms['off'] / ms['bi']:>6.2f} {'yes' if rows[-1]['auto_groups'] else 'no':>6}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/cascade_threshold")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="layers of KV per timing (each read cold)")
    parser.add_argument("--shared", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--flush-mib", type=int, default=512, help="buffer read before each timing to empty the caches")
    parser.add_argument("--ab", action="store_true", help="off / on / auto alternated in one process (see above)")
    parser.add_argument("--rounds", type=int, default=8, help="with --ab: turns of off, on and auto")
    args = parser.parse_args(argv)
    if native.load() is None:
        print("needs the native kernels (no C compiler here)")
        return 1
    # The shared items' tiles run bf16 on AVX512_BF16, else fp32: the dtype models compute in.
    dtype = BF16 if cpu_features().avx512_bf16 else torch.float32
    flush = torch.ones(args.flush_mib << 20, dtype=torch.int8)
    if args.ab:
        return ab_main(args, dtype, flush)
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


def ab_main(args: argparse.Namespace, dtype: torch.dtype, flush: torch.Tensor) -> int:
    """The A/B table, with the machine's limits measured before and after it."""
    before = machine_limits(dtype)
    caches = cpu_caches()
    print(f"{'members':>7} {'shared':>7} {'saved KiB':>10} {'off ms':>8} {'on ms':>8} {'auto ms':>8} {'off/on':>7} {'off/auto':>8} {'off/no-tiles':>13} {'off/bi':>6} {'auto':>6}")
    rows = ab_rows(args, dtype, flush)
    after = machine_limits(dtype)
    for name, limits in (("before", before), ("after", after)):
        print(f"{name}: {limits['cpu']}: read {limits['read_bandwidth_gb_s']:.1f} GB/s, "
              f"{str(dtype).removeprefix('torch.')} matmul {limits['matmul_gflops']:.0f} GFLOP/s")  # fmt: skip
    print(f"L2 {caches.l2_bytes >> 10} KiB per core; auto: {cpu_decode.cascade_thresholds(*HEADS['SmolLM2-135M'], dtype.itemsize)}")
    results = dict(before=before, after=after, l2_bytes=caches.l2_bytes, dtype=str(dtype), layers=args.layers, rounds=args.rounds, rows=rows)
    save_results(args.out, "cascade_ab", results, lambda path: _plot_ab(rows, path))
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


def _plot_ab(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for members in dict.fromkeys(r["members"] for r in rows):
        mine = [r for r in rows if r["members"] == members]
        for key, style in (("off_over_on", "o--"), ("off_over_auto", "s-")):
            ax.plot([r["shared"] for r in mine], [r[key] for r in mine], style, label=f"{members} members, {key.replace('_', ' ')}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("shared tokens")
    ax.set_ylabel("off time / cascade time")
    ax.legend(fontsize=7)
    fig.suptitle("Cascade off, on and auto, alternated in one process")
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
