"""A decode step of --num-seqs requests x --context tokens, in process, against this machine's
bound from the bytes the step actually reads: the weights as the loaded model holds them
(quantized weights' own bytes where the checkout keeps them quantized) plus the KV pages read,
at the pool's dtype, over the read bandwidth measured in the same run.

    python -m radixkv.scenarios.decode_bound [--model FILE.gguf] [--num-seqs 32 --context 1024]
        [--weight-dtype ... --kv-dtype ... --quant-kernel ...]

The weights' bytes are counted from the model's tensors (parameters and buffers, each storage
once), not from its shape: the embedding table counts only where it is the lm_head too (a
lookup reads one row per token). The flops bound at the measured matmul rate is printed beside.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from radixkv.scenarios.bounds import Costs, weight_bytes_read


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2's GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed (the median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--weight-dtype", default=None)
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--quant-kernel", default=None)
    parser.add_argument("--out", default="out/decode_bound")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    from radixkv.model.loader import default_model_gguf
    from radixkv.scenarios.decode_profile import median_step_s
    from radixkv.scenarios.machine import machine_limits
    from radixkv.scenarios.serve_http import engine_knobs

    model = args.model or str(default_model_gguf())
    knobs = engine_knobs(dict(weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, quant_kernel=args.quant_kernel))
    llm = _decoding_llm(model, args, knobs)
    engine = llm.engine
    reads_before = (engine.counters.num_kv_tokens_read, engine.counters.num_kv_tokens_read_shared)
    step_s = median_step_s(engine, args.steps)
    kv_tokens = (engine.counters.num_kv_tokens_read - reads_before[0] - (engine.counters.num_kv_tokens_read_shared - reads_before[1])) / args.steps
    kv_token_bytes = engine.pool.page_nbytes / engine.pool.page_size
    weights, by_dtype = weight_bytes_read(engine.loaded.model)
    engine.abort_all()
    limits = machine_limits(engine.dtype)
    bandwidth = limits["read_bandwidth_gb_s"] * 1e9
    kv_bytes = kv_tokens * kv_token_bytes
    bound_s = (weights + kv_bytes) / bandwidth
    costs = Costs.of(engine.model_config, torch.finfo(engine.dtype).bits // 8)
    flops_s = costs.decode_step_flops([args.context + args.steps // 2] * args.num_seqs) / (limits["matmul_gflops"] * 1e9)
    return dict(
        model=model, num_seqs=args.num_seqs, context=args.context, steps=args.steps, dtype=str(engine.dtype).removeprefix("torch."),
        knobs=knobs, kv_dtype=str(engine.pool.k_cache[0].dtype).removeprefix("torch."), step_s=step_s,
        weight_bytes=weights, weight_bytes_by_dtype=by_dtype, weight_bytes_at_compute_dtype=costs.weight_bytes,
        kv_tokens_read_per_step=kv_tokens, kv_bytes_per_token=kv_token_bytes, kv_bytes=kv_bytes,
        bound_s=bound_s, step_over_bound=step_s / bound_s, flops_bound_s=flops_s, **limits,
    )  # fmt: skip


def _decoding_llm(model: str, args: argparse.Namespace, knobs: dict[str, str]):
    """start_decoding's LLM, built with the new knobs (start_decoding takes none)."""
    from radixkv import LLM
    from radixkv.scenarios.decode_profile import start_decoding

    pages = args.num_seqs * (-(-(args.context + args.steps + 8) // 16)) + 64
    llm = LLM(model, dtype=args.dtype, num_pages=pages, max_num_seqs=args.num_seqs, max_batch_tokens=4096, **knobs)
    return start_decoding(model, args.dtype, args.num_seqs, args.context, args.steps, llm=llm)


def print_result(r: dict) -> None:
    print(f"\ndecode_bound: {r['model']}, {r['num_seqs']} requests x {r['context']} tokens, compute {r['dtype']}, KV {r['kv_dtype']}")
    print(f"  {r['cpu']}: read {r['read_bandwidth_gb_s']:.1f} GB/s, {r['matmul_dtype']} matmul {r['matmul_gflops']:.0f} GFLOP/s (this run)")
    held = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["weight_bytes_by_dtype"].items())
    print(f"  weights read         {r['weight_bytes'] / 2**20:9.1f} MiB as held ({held}); {r['weight_bytes_at_compute_dtype'] / 2**20:.1f} MiB by shape at {r['dtype']}")
    print(f"  KV read              {r['kv_bytes'] / 2**20:9.1f} MiB ({r['kv_tokens_read_per_step']:.0f} tokens x {r['kv_bytes_per_token']:.0f} B)")
    print(f"  step time            {r['step_s'] * 1e3:9.1f} ms (median of {r['steps']})")
    print(f"  bound (bytes / bw)   {r['bound_s'] * 1e3:9.1f} ms")
    print(f"  step / bound         {r['step_over_bound']:9.2f}")
    print(f"  flops bound          {r['flops_bound_s'] * 1e3:9.1f} ms (at the matmul rate, for comparison)")


def plot(r: dict, path: Path) -> None:
    from radixkv.scenarios.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    bandwidth = r["read_bandwidth_gb_s"] * 1e9
    ax.barh(["step"], [r["step_s"] * 1e3], color="tab:blue")
    ax.barh(["bound"], [r["weight_bytes"] / bandwidth * 1e3], color="tab:gray", label="weights")
    ax.barh(["bound"], [r["kv_bytes"] / bandwidth * 1e3], left=[r["weight_bytes"] / bandwidth * 1e3], color="tab:orange", label="KV")
    ax.set_xlabel("ms")
    ax.set_title(f"decode step {r['num_seqs']} x {r['context']}: {r['step_over_bound']:.2f}x the bound — {r['cpu']}", fontsize=8)
    ax.legend(fontsize=8)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    result["command"] = " ".join(["python -m radixkv.scenarios.decode_bound", *(argv if argv is not None else sys.argv[1:])])
    print_result(result)
    from radixkv.scenarios.plots import save_results

    save_results(args.out, "decode_bound", result, lambda path: plot(result, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
