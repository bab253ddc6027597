"""Time to first token after a restart: a long cached system prompt served from the disk tier
against recomputing it, and against a RAM hit. One engine computes the prompt and closes
(writing its cache to disk); a fresh engine on the same directory then serves another question
on the same system prompt; a fresh engine without the tier computes it again.

    radixkv bench disk_restart [--system-len 4096] [--question-len 32] [--model PATH] [--out out/disk_restart]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.plots import pyplot, save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--system-len", type=int, default=4096, help="tokens of the cached system prompt")
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a fresh temporary one)")
    parser.add_argument("--out", default="out/disk_restart")
    args = parser.parse_args(argv)

    from radixkv.engine.build import load_engine_model
    from radixkv.model.device import resolve_device

    base = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.system_len + args.question_len + 8)
    loaded = load_engine_model(base, resolve_device(base.device))
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(args.system_len)]
    questions = [[rng.randrange(100, vocab) for _ in range(args.question_len)] for _ in range(3)]
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="radixkv-disk-"))

    rows = []
    first = _engine(loaded, base, directory)
    rows.append(_ttft(first, "cold: compute the system prompt", system + questions[0]))
    start = time.perf_counter()
    written = first.close()
    persist_s = time.perf_counter() - start
    disk_stats = first.cache_view.disk_stats()
    disk_bytes = disk_stats.bytes_used if disk_stats else 0
    page_size = first.config.page_size
    num_blocks = args.system_len // page_size
    # The engine's fitted compute cost for the system prompt's blocks, learnt from the cold run.
    compute_s = first.compute_cost.estimate_s(0, num_blocks * page_size)
    fit = first.compute_cost.coefficients()
    del first

    warm = _engine(loaded, base, directory)
    rows.append(_ttft(warm, "restart: system prompt from disk", system + questions[1]))
    rows.append(_ttft(warm, "then: system prompt from RAM", system + questions[2]))
    warm_disk = warm.cache_view.disk_stats()
    hit_blocks = warm_disk.hit_blocks if warm_disk else 0
    read_s = warm_disk.read_s_per_block * num_blocks if warm_disk and warm_disk.read_s_per_block else None
    warm.close()
    del warm
    recompute = _engine(loaded, base, None)
    rows.append(_ttft(recompute, "restart without the tier: recompute", system + questions[1]))

    limits = machine_limits(loaded.dtype)
    print(
        f"{limits['cpu']}, {limits['torch_threads']} threads, read {limits['read_bandwidth_gb_s']:.1f} GB/s, "
        f"{limits['matmul_dtype']} matmul {limits['matmul_gflops']:.0f} GFLOP/s; model {loaded.path} {loaded.dtype}\n"
    )
    print(f"{'case':<40} {'TTFT s':>8} {'cached tokens':>14}")
    for row in rows:
        print(f"{row['case']:<40} {row['ttft_s']:>8.3f} {row['cached_tokens']:>14,}")
    print(
        f"\nclose wrote {written} blocks ({disk_bytes / 2**20:,.1f} MiB) in {persist_s:.2f} s; "
        f"the restart loaded {hit_blocks} blocks; disk vs recompute: {rows[3]['ttft_s'] / rows[1]['ttft_s']:.1f}x faster"
    )
    if read_s is not None and compute_s is not None and fit is not None:
        # What the engine weighs before reading a disk hit (DiskLoader.pays).
        print(
            f"the decision for {num_blocks} blocks: reading {read_s:.3f} s (measured, {read_s / num_blocks * 1e3:.2f} ms/block) "
            f"vs computing {compute_s:.2f} s (fitted: {fit[0] * 1e3:.3f} ms/token + {fit[1] * 1e9:.2f} ns/attended position) "
            f"-> {'read' if read_s < compute_s else 'compute'}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": loaded.path,
        "dtype": str(loaded.dtype),
        "system_len": args.system_len,
        "question_len": args.question_len,
        "machine": platform.machine(),
        "persist_blocks": written,
        "persist_s": persist_s,
        "disk_bytes": disk_bytes,
        "decision": {"blocks": num_blocks, "read_s": read_s, "compute_s": compute_s, "fit_s_per_token_and_attended": fit},
        "machine_limits": limits,
        "rows": rows,
    }
    (out / "disk_restart.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(rows, out / "disk_restart.png")
    print(f"wrote {out / 'disk_restart.json'} and {out / 'disk_restart.png'}")
    return 0


def _engine(loaded, base: EngineConfig, directory: Path | None) -> Engine:
    from dataclasses import replace

    return Engine(replace(base, kv_disk_dir=str(directory) if directory else None), loaded=loaded)


def _ttft(engine: Engine, case: str, prompt: list[int]) -> dict:
    """Seconds from submission to the first token (max_tokens=1: the whole request)."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1))
    output = None
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == request_id and delta.finished:
                output = delta.output
    elapsed = time.perf_counter() - start
    assert output is not None
    return {"case": case, "ttft_s": elapsed, "cached_tokens": output.num_cached_tokens, "prompt_tokens": len(prompt)}


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([row["case"] for row in rows][::-1], [row["ttft_s"] for row in rows][::-1], color=["C3", "C2", "C0", "C1"])
    ax.set_xlabel("time to first token (s)")
    ax.set_title(f"{rows[0]['prompt_tokens']:,}-token prompt: TTFT after a restart", fontsize=10)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
