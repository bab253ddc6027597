"""Turns peer results into the table, JSON and plots every scenario reports.

Ratios are each peer's figure over radixkv's, so "wall x" of 10 means ten times slower.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from radixkv.scenarios.peers import PeerResult, Workload
from radixkv.scenarios.plots import pyplot, save


def min_prefill_tokens(prompts: list[list[int]], page_size: int) -> int:
    """Fewest prompt tokens any prefix cache must compute: each distinct full block once,
    plus each prompt's tail after the blocks it may reuse (at least its last token)."""
    distinct: set[tuple[int, ...]] = set()
    total = 0
    for prompt in prompts:
        reusable = (len(prompt) - 1) // page_size
        for block in range(reusable):
            distinct.add(tuple(prompt[: (block + 1) * page_size]))
        total += len(prompt) - reusable * page_size
    return total + len(distinct) * page_size


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(workload: Workload, results: list[PeerResult]) -> list[dict]:
    base = next((r for r in results if r.peer == "radixkv" and not r.error), None)
    reference = next((r for r in results if r.peer == "radixkv-nocache" and not r.error), None)
    # transformers' generate, one request at a time: the plainest reference for greedy tokens.
    transformers = next((r for r in results if r.peer == "hf-generate" and not r.error), None)
    rows = []
    for r in results:
        ttft = [t for t in r.ttft_s if t is not None]
        row = dict(
            peer=r.peer,
            error=r.error,
            wall_s=r.wall_s,
            output_tokens=r.output_tokens,
            tokens_per_s=r.tokens_per_s,
            ttft_mean_s=statistics.fmean(ttft) if ttft else None,
            ttft_p90_s=percentile(ttft, 0.9) if ttft else None,
            prefill_tokens_computed=r.prefill_tokens_computed,
            cache_hit_rate=r.cache_hit_rate,
            peak_rss_mib=r.peak_rss_bytes / 2**20,
            wall_ratio=r.wall_s / base.wall_s if base and base.wall_s and not r.error else None,
            throughput_ratio=r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s and not r.error else None,
            same_tokens_as_nocache=_same_outputs(r, reference),
            same_tokens_as_hf_generate=_same_outputs(r, transformers),
        )
        rows.append(row)
    return rows


def _same_outputs(result: PeerResult, reference: PeerResult | None) -> int | None:
    """How many requests got exactly the reference's tokens (None: no reference ran)."""
    if reference is None or result.error:
        return None
    return sum(a == b for a, b in zip(result.output_token_ids, reference.output_token_ids))


def print_table(workload: Workload, rows: list[dict]) -> None:
    prompts = workload.prompts
    minimum = min_prefill_tokens(prompts, workload.page_size)
    print(
        f"\n{workload.name}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens "
        f"(minimum to compute: {minimum}), {workload.output_len} output tokens each; "
        f"dtype {workload.dtype}, device {workload.device}"
    )
    header = (
        f"{'peer':<16}{'wall s':>9}{'x radixkv':>10}{'tok/s':>9}{'ttft mean':>10}{'ttft p90':>9}"
        f"{'prefill':>9}{'x min':>7}{'hit':>6}{'RSS MiB':>9}{'same':>6}{'=hf':>5}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if row["error"]:
            print(f"{row['peer']:<16} failed: {row['error'].splitlines()[-1][:90]}")
            continue
        prefill = row["prefill_tokens_computed"]
        print(
            f"{row['peer']:<16}{row['wall_s']:>9.2f}{_fmt(row['wall_ratio'], '.2f')}{row['tokens_per_s']:>9.1f}"
            f"{_fmt(row['ttft_mean_s'], '.2f')}{_fmt(row['ttft_p90_s'], '.2f', 9)}"
            f"{_fmt(prefill, 'd', 9)}{_fmt(prefill / minimum if prefill is not None else None, '.2f', 7)}"
            f"{_fmt(row['cache_hit_rate'], '.0%', 6)}{row['peak_rss_mib']:>9.0f}"
            f"{_fmt(row['same_tokens_as_nocache'], 'd', 6)}{_fmt(row['same_tokens_as_hf_generate'], 'd', 5)}"
        )


def _fmt(value, spec: str, width: int = 10) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_bound(rows: list[dict], bound: dict) -> None:
    """Each peer's wall time over the workload's bound on this machine (scenarios/bounds.py)."""
    print(
        f"\nbound on {bound['cpu']}: {bound['bound_s']:.2f} s (prefill {bound['prefill_bound_s']:.2f} s + decode "
        f"{bound['decode_bound_s']:.2f} s) at {bound['read_bandwidth_gb_s']:.1f} GB/s read and "
        f"{bound['matmul_gflops']:.0f} GFLOP/s {bound['matmul_dtype']} matmul, measured in this run"
    )
    for row in rows:
        if not row["error"]:
            row["wall_over_bound"] = row["wall_s"] / bound["bound_s"]
            print(f"  {row['peer']:<16} wall / bound {row['wall_over_bound']:6.2f}")


def write_report(workload: Workload, results: list[PeerResult], out_dir: Path, extra: dict | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(workload, results)
    print_table(workload, rows)
    if extra and "bound" in extra:
        print_bound(rows, extra["bound"])
    report = dict(
        scenario=workload.name,
        num_requests=len(workload.prompts),
        prompt_tokens=sum(map(len, workload.prompts)),
        min_prefill_tokens=min_prefill_tokens(workload.prompts, workload.page_size),
        output_len=workload.output_len,
        model=workload.model or "SmolLM2-135M-Instruct",
        dtype=workload.dtype,
        device=workload.device,
        rows=rows,
        raw=[{k: v for k, v in asdict(r).items() if k != "output_token_ids"} for r in results],
        **(extra or {}),
    )
    path = out_dir / f"{workload.name}.json"
    path.write_text(json.dumps(report, indent=2))
    _plot(workload, rows, results, out_dir)
    print(f"\nwrote {path} and plots in {out_dir}")
    return report


def _plot(workload: Workload, rows: list[dict], results: list[PeerResult], out_dir: Path) -> None:
    plt = pyplot()

    ok = [r for r in rows if not r["error"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [r["peer"] for r in ok]
    axes[0].bar(names, [r["tokens_per_s"] for r in ok], color="tab:blue")
    axes[0].set_title("output tokens / s")
    ttfts = [[t for t in res.ttft_s if t is not None] for res in results if not res.error]
    axes[1].boxplot(ttfts, tick_labels=names)
    axes[1].set_title("time to first token (s, from t0)")
    minimum = min_prefill_tokens(workload.prompts, workload.page_size)
    computed = [r["prefill_tokens_computed"] or 0 for r in ok]
    axes[2].bar(names, computed, color="tab:orange", label="computed")
    axes[2].axhline(minimum, color="black", linestyle="--", label="minimum (each distinct block once)")
    axes[2].set_title("prefill tokens computed (0: not reported)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{workload.name}: {len(workload.prompts)} requests, {workload.output_len} output tokens")
    save(fig, out_dir / f"{workload.name}.png")
