"""Where a decode step's time goes: 32 running requests at ~1k-token contexts, against an
honest bound measured in the same run: the larger of reading the weights plus the KV once at
this machine's read bandwidth, and the step's flops at its matmul rate in the step's dtype.

    python -m radixkv.scenarios.decode_profile [--dtype auto] [--out out/decode_profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from radixkv.scenarios.bounds import Costs
from radixkv.scenarios.machine import copy_bandwidth_bytes_per_s, machine_limits


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all of them except the embedding table, of
    which it reads a row per request (unless the lm_head is that same tensor)."""
    embedding = model.embed_tokens.weight
    tied = any(p is embedding for name, p in model.named_parameters() if not name.startswith("embed_tokens"))
    return sum(
        p.numel() * p.element_size() for p in model.parameters() if p is not embedding or tied
    )


def profile_decode(model: str | None = None, dtype: str = "auto", num_seqs: int = 32, context: int = 1024, steps: int = 8) -> dict:
    from radixkv import LLM, SamplingParams

    page_size = 16
    pages = num_seqs * (-(-(context + steps + 8) // page_size)) + 64
    llm = LLM(model, dtype=dtype, num_pages=pages, max_num_seqs=num_seqs, max_batch_tokens=4096)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    for i in range(num_seqs):  # distinct prompts: no sharing, every request attends to its own KV
        prompt = [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(context)]
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 64, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.waiting) or engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    engine.step_times.reset()
    step_s = median_step_s(engine, steps)
    phases = {name: seconds / steps for name, seconds in asdict(engine.step_times).items()}
    breakdown = kernel_breakdown(engine, steps)
    for request_id in list(engine._requests):
        engine.abort(request_id)

    mc = engine.model_config
    element = torch.finfo(engine.dtype).bits // 8
    weight_bytes = decode_weight_bytes(engine.loaded.model)
    kv_bytes = num_seqs * (context + steps) * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * element
    flops = Costs.of(mc, element).decode_step_flops([context + steps // 2] * num_seqs)
    limits = machine_limits(engine.dtype)
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    read_s = (weight_bytes + kv_bytes) / (limits["read_bandwidth_gb_s"] * 1e9)
    compute_s = flops / (limits["matmul_gflops"] * 1e9)
    ideal_s = max(read_s, compute_s)
    result = dict(
        num_seqs=num_seqs,
        context=context,
        dtype=str(engine.dtype),
        step_ms=step_s * 1e3,
        phases_ms={k: v * 1e3 for k, v in phases.items()},
        engine_overhead_fraction=(step_s - phases["forward"]) / step_s,
        weight_mib=weight_bytes / 2**20,
        kv_mib=kv_bytes / 2**20,
        step_gflop=flops / 1e9,
        **limits,
        copy_bandwidth_gb_s=copy_bandwidth / 1e9,
        read_once_ms=read_s * 1e3,
        flops_at_matmul_rate_ms=compute_s * 1e3,
        ideal_ms=ideal_s * 1e3,
        bound_by="memory" if read_s >= compute_s else "compute",
        step_over_ideal=step_s / ideal_s,
        native_decode=native_decode_used(engine),
        fused_decode=engine.loaded.model.fused_decode is not None,
        breakdown_ms=breakdown,
        torch_threads=torch.get_num_threads(),
    )
    _print(result)
    return result


def median_step_s(engine, steps: int) -> float:
    """The median of `steps` engine steps' wall times: a shared VM stalls a step now and then."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextmanager
def _timed(owner, name: str, totals: dict[str, float], label: str):
    """owner.name, timed into totals[label] while the block runs."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - begin

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def kernel_breakdown(engine, steps: int) -> dict[str, float]:
    """Where a decode step's time goes, in ms: the same steps run layer by layer (the fused
    call hides its parts from Python), each kernel timed around its call. The layer-by-layer
    step is itself reported, so the fused call's saving shows too."""
    from radixkv.cpu import decode, linear
    from radixkv.model import llama

    model = engine.loaded.model
    totals: dict[str, float] = defaultdict(float)
    fused, model.fused_decode = model.fused_decode, None
    try:
        with ExitStack() as stack:
            stack.enter_context(_timed(decode, "paged_decode", totals, "attention (paged decode)"))
            stack.enter_context(_timed(decode, "store_kv", totals, "KV stores"))
            # Packed bf16 linears, and plain ones (fp32, or no oneDNN): every product is a linear's.
            stack.enter_context(_timed(linear.PackedLinear, "forward", totals, "linears (incl. lm_head)"))
            stack.enter_context(_timed(torch.nn.Linear, "forward", totals, "linears (incl. lm_head)"))
            for op in ("add_rms_norm", "apply_rope", "silu_mul"):
                stack.enter_context(_timed(llama, op, totals, "norms, rope, silu"))
            stack.enter_context(_timed(llama.CausalLM, "forward", totals, "forward"))
            engine.step()  # the first step after the switch warms the module path
            per_step = [_timed_step(engine, totals) for _ in range(steps)]
    finally:
        model.fused_decode = fused
    # Medians per part, like the step time: a stalled step would skew a mean.
    return {label: statistics.median(step[label] for step in per_step) * 1e3 for label in per_step[0]}


_PARTS = ("attention (paged decode)", "linears (incl. lm_head)", "norms, rope, silu", "KV stores")


def _timed_step(engine, totals: dict[str, float]) -> dict[str, float]:
    """One engine step's seconds per part, from the timers kernel_breakdown installed."""
    totals.clear()
    start = time.perf_counter()
    engine.step()
    step = time.perf_counter() - start
    parts = {part: totals.get(part, 0.0) for part in _PARTS}
    parts["python between kernels"] = totals["forward"] - sum(parts.values())
    parts["outside the forward"] = step - totals["forward"]
    parts["step (layer by layer)"] = step
    return parts


def native_decode_used(engine) -> bool:
    """Whether decode reads the pages through the native kernel (the CPU backend, bf16 or fp32)."""
    capabilities = engine.loaded.model.attention.capabilities
    return capabilities.fused_cpu_decode and engine.dtype in (torch.bfloat16, torch.float32)


def _print(r: dict) -> None:
    print(f"\ndecode step, {r['num_seqs']} requests at {r['context']} tokens ({r['dtype']}, {r['torch_threads']} threads)")
    print(f"  step time            {r['step_ms']:8.1f} ms (median of the steps)")
    for phase, ms in r["phases_ms"].items():
        print(f"    {phase:<18} {ms:8.1f} ms  ({ms / r['step_ms']:.0%})")
    print(f"  machine              {r['cpu']}")
    print(f"  read bandwidth       {r['read_bandwidth_gb_s']:8.1f} GB/s (fastest streaming read)")
    print(f"  copy bandwidth       {r['copy_bandwidth_gb_s']:8.1f} GB/s (read + written)")
    print(f"  matmul rate          {r['matmul_gflops']:8.0f} GFLOP/s ({r['matmul_dtype']}, torch)")
    print(f"  weights + KV read    {r['weight_mib']:.0f} + {r['kv_mib']:.0f} MiB -> {r['read_once_ms']:.1f} ms at the read bandwidth")
    print(f"  step flops           {r['step_gflop']:.2f} GFLOP -> {r['flops_at_matmul_rate_ms']:.1f} ms at the matmul rate")
    print(f"  bound                {r['ideal_ms']:8.1f} ms ({r['bound_by']}) -> step is {r['step_over_ideal']:.2f}x the bound")
    print(f"  attention            {'native paged kernel (KV read in place)' if r['native_decode'] else 'gather + SDPA'}")
    print(f"  decoder layers       {'one native call per step (fused)' if r['fused_decode'] else 'module by module'}")
    print("  where the time goes (the same steps layer by layer, each kernel timed):")
    for part, ms in r["breakdown_ms"].items():
        print(f"    {part:<26} {ms:8.1f} ms")
    print(f"  engine's own work    {r['engine_overhead_fraction']:.1%} of the step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-seqs", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=1024, help="tokens of each request's prompt")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed")
    parser.add_argument("--out", default="out/decode_profile")
    args = parser.parse_args(argv)
    result = profile_decode(args.model, args.dtype, args.num_seqs, args.context, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode_profile_{result['dtype'].removeprefix('torch.')}.json"
    path.write_text(json.dumps(result, indent=2))
    _plot(result, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")
    return 0


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = {k: v for k, v in r["breakdown_ms"].items() if not k.startswith("step")}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(["step (as run)", "bound"], [r["step_ms"], r["ideal_ms"]], color=["tab:blue", "tab:gray"])
    left = 0.0
    for name, ms in parts.items():
        ax.barh(["layer by layer"], [max(ms, 0.0)], left=left, label=name)
        left += max(ms, 0.0)
    ax.set_xlabel("ms")
    ax.set_title(f"decode step, {r['num_seqs']} x {r['context']} tokens, {r['dtype']} — {r['cpu']}", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
