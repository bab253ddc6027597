"""Peak memory of loading a model: each load runs in a fresh subprocess (an engine with a small KV
pool, as `radixkv serve` builds it), whose peak RSS (/proc's VmHWM) is reported beside the
bytes its weights hold and the GGUF's own tensor bytes. "cold" loads into an empty cache directory
(transformers builds the config and tokenizer once, in a subprocess of the loader's: its peak is
reported apart), "warm" loads again from it.

    radixkv bench load_rss [--model FILE_OR_FOLDER ...] [--weight-dtype auto ...] [--num-pages 64] [--out out/load_rss]

Linux only (/proc/self/status, /proc/self/statm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD_FLAG = "--child"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="HF folder or .gguf (repeatable); default SmolLM2-135M-Instruct")
    parser.add_argument("--weight-dtype", action="append", default=None, help="EngineConfig.weight_dtype (repeatable); default auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-pages", type=int, default=64, help="KV pages of the engine's pool (small: the weights are measured)")
    parser.add_argument("--out", default="out/load_rss")
    args = parser.parse_args(argv)

    rows = []
    for model in args.model or [None]:
        for weight_dtype in args.weight_dtype or ["auto"]:
            with tempfile.TemporaryDirectory(prefix="radixkv-load-rss-") as cache:
                for phase in ("cold", "warm"):
                    row = measure(model, weight_dtype, args.dtype, args.num_pages, cache)
                    rows.append({"phase": phase, **row})
                    print(_line(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": platform.processor() or platform.machine(), "num_pages": args.num_pages, "rows": rows}
    (out / "load_rss.json").write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(rows))
    return 0


def measure(model: str | None, weight_dtype: str, dtype: str, num_pages: int, cache_dir: str) -> dict:
    """Load once in a fresh subprocess; its report, with its peak RSS in MB."""
    import radixkv

    spec = json.dumps({"model": model, "weight_dtype": weight_dtype, "dtype": dtype, "num_pages": num_pages, "cache_dir": cache_dir})
    env = dict(os.environ)
    # The child imports the radixkv this process imported (a worktree's, under PYTHONPATH).
    root = str(Path(radixkv.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), _CHILD_FLAG, spec], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load of {model!r} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(spec: dict) -> dict:
    """Runs in the subprocess: build an engine, report what the load held."""
    start = time.perf_counter()
    from radixkv.config import EngineConfig
    from radixkv.engine.engine import Engine
    from radixkv.model.gguf import GGUFFile
    from radixkv.model.quantized import weight_bytes
    from radixkv.scenarios.machine import process_memory

    engine = Engine(EngineConfig(
        model=spec["model"], dtype=spec["dtype"], device="cpu", weight_dtype=spec["weight_dtype"],
        num_pages=spec["num_pages"], cache_dir=spec["cache_dir"],
    ))  # fmt: skip
    seconds = time.perf_counter() - start
    loaded = engine.loaded
    config = loaded.config
    file_bytes = None
    if loaded.gguf is not None:
        file_bytes = GGUFFile(loaded.gguf, config.num_q_heads, config.num_kv_heads).tensor_bytes
    return {
        "model": Path(loaded.gguf or loaded.path).name,
        "weight_dtype": spec["weight_dtype"],
        "weight_format": loaded.weight_format,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "layers": config.num_layers,
        "hidden": config.hidden_size,
        "load_s": round(seconds, 2),
        # VmHWM: getrusage's ru_maxrss survives exec, so this child's would be at least its parent's.
        "peak_rss_mb": round(process_memory()["peak_rss_bytes"] / 2**20, 1),
        "rss_after_mb": round(process_memory()["rss_bytes"] / 2**20, 1),
        # A cold load reads a GGUF's config and tokenizer in a subprocess of its own (the loader's
        # _in_subprocess): its peak, apart from the serving process's; at least this process's
        # RSS when it started it (ru_maxrss survives exec).
        "prepare_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "weight_mb": round(weight_bytes(loaded.model) / 2**20, 1),
        "file_tensor_mb": None if file_bytes is None else round(file_bytes / 2**20, 1),
        "kv_pool_mb": round(engine.pool.page_nbytes * engine.pool.num_pages / 2**20, 1),
    }


def _line(row: dict) -> str:
    return f"{row['model']} {row['weight_dtype']} {row['phase']}: peak {row['peak_rss_mb']} MB, weights {row['weight_mb']} MB, {row['load_s']} s"


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (the README's)."""
    header = "| model | weight_dtype (held as) | load | peak RSS MB | RSS after MB | weights MB | GGUF tensors MB | load s | config+tokenizer subprocess peak MB |"
    lines = [header, "|" + "---|" * 9]
    for row in rows:
        held = f"{row['weight_dtype']} ({row['weight_format']}, {row['dtype']})"
        lines.append(
            f"| {row['model']} | {held} | {row['phase']} | {row['peak_rss_mb']} | {row['rss_after_mb']} | {row['weight_mb']} "
            f"| {row['file_tensor_mb'] if row['file_tensor_mb'] is not None else '-'} | {row['load_s']} | {row['prepare_peak_rss_mb'] or '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == _CHILD_FLAG:
        print(json.dumps(_child(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
