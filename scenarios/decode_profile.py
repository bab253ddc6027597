"""Where a decode step's time goes: 32 running requests at ~1k-token contexts, against an
honest bound measured in the same run: the larger of reading the weights plus the KV once at
this machine's read bandwidth, and the step's flops at its matmul rate in the step's dtype.

    python -m radixkv.scenarios.decode_profile [--dtype auto] [--out out/decode_profile]
    python -m radixkv.scenarios.decode_profile --shared-prefix 1024 [--group-sizes 1,2,4,8,16,32]

--shared-prefix N: the requests share N-token prefixes in groups (2 groups of 16 by default)
with --own-tokens of their own each, timed with cascade decode (EngineConfig.share_decode_reads)
on and off in the same run: step time, attention time, KV read per step against the unique KV,
and the step time against the group size.
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

from radixkv.model.fused_layers import fused_decode
from radixkv.scenarios.bounds import Costs, weight_bytes_read
from radixkv.scenarios.machine import copy_bandwidth_bytes_per_s, machine_limits
from radixkv.scenarios.plots import pyplot, save


def prompts_for(vocab: int, num_seqs: int, context: int, shared_prefix: int = 0, group_size: int = 1) -> list[list[int]]:
    """num_seqs prompts of `context` tokens; consecutive groups of group_size share their first
    shared_prefix tokens (0: every prompt distinct, each request attends to its own KV)."""
    prompts = []
    for i in range(num_seqs):
        group = i // group_size
        prefix = [(11 * group + 17 * j) % (vocab - 10) + 5 for j in range(shared_prefix)]
        own = [(7 * i + 13 * j + 3) % (vocab - 10) + 5 for j in range(context - shared_prefix)]
        prompts.append(prefix + own)
    return prompts


def profile_decode(
    model: str | None = None,
    dtype: str = "auto",
    num_seqs: int = 32,
    context: int = 1024,
    steps: int = 8,
    shared_prefix: int = 0,
    group_size: int = 1,
    share_reads: bool = True,
    quiet: bool = False,
    breakdown: bool | None = None,
    llm=None,
    limits: dict | None = None,
    kv_dtype: str = "auto",
) -> dict:
    """One decode step's time and where it goes, against the bound. llm/limits: an LLM and
    machine limits from an earlier call to reuse (its cache stays warm; share_reads is set on
    its backend, so on and off run over the very same pages)."""
    wanted = not quiet if breakdown is None else breakdown
    # Room for the timed steps, the two breakdowns' and the split rows' turns.
    room = steps * 3 + 2 * SPLIT_TURNS * SPLIT_TURN_STEPS
    llm = start_decoding(model, dtype, num_seqs, context, room, shared_prefix, group_size, share_reads, llm=llm, kv_dtype=kv_dtype)
    engine = llm.engine
    reads_before = (engine.counters.num_kv_tokens_read, engine.counters.num_kv_tokens_read_shared)
    step_s = median_step_s(engine, steps)
    kv_read = engine.counters.num_kv_tokens_read - reads_before[0]
    kv_shared = engine.counters.num_kv_tokens_read_shared - reads_before[1]
    phases = {name: seconds / steps for name, seconds in asdict(engine.step_times).items()}
    fused = fused_decode(engine.loaded.model)
    fused_parts = fused_breakdown(engine, steps) if wanted and fused is not None else {}
    breakdown = kernel_breakdown(engine, steps) if wanted else {}
    split_turns = split_rows_in_turns(engine) if wanted else {}
    engine.abort_all()

    mc = engine.model_config
    element = torch.finfo(engine.dtype).bits // 8
    # The bound counts each distinct KV token once: a shared prefix need be read only once.
    distinct_tokens = num_seqs * (context + steps) - (num_seqs - num_seqs // group_size) * shared_prefix
    kv_cache = engine.pool.k_cache[0]
    scale_bytes = 2 if kv_cache.dtype == torch.int8 else 0  # int8 pages: an fp16 scale per token and head
    kv_bytes = distinct_tokens * mc.num_layers * mc.num_kv_heads * (mc.head_dim * kv_cache.element_size() + scale_bytes) * 2
    costs = Costs.of(mc, element)
    # Every linear's weights, the lm_head included, read once, in the format the model holds
    # them (a GGUF's quantized blocks are a fraction of the compute dtype's bytes).
    weight_bytes = weight_bytes_read(engine.loaded.model)[0]
    flops = costs.decode_step_flops([context + steps // 2] * num_seqs)
    limits = limits or machine_limits(engine.dtype)
    copy_bandwidth = None if quiet else copy_bandwidth_bytes_per_s()
    read_s = (weight_bytes + kv_bytes) / (limits["read_bandwidth_gb_s"] * 1e9)
    compute_s = flops / (limits["matmul_gflops"] * 1e9)
    ideal_s = max(read_s, compute_s)
    result = dict(
        num_seqs=num_seqs,
        context=context,
        shared_prefix=shared_prefix,
        group_size=group_size,
        share_reads=share_reads,
        kv_tokens_read_per_step=kv_read / steps,
        kv_tokens_shared_per_step=kv_shared / steps,
        # What the kernel reads from the pool per step: a group's prefix once, not per member.
        kv_tokens_fetched_per_step=(kv_read - kv_shared) / steps,
        kv_tokens_unique_per_step=distinct_tokens,
        dtype=str(engine.dtype),
        kv_dtype=str(kv_cache.dtype),
        step_ms=step_s * 1e3,
        phases_ms={k: v * 1e3 for k, v in phases.items()},
        # Means over the same steps on both sides (step_s is a median, another statistic).
        engine_overhead_fraction=(sum(phases.values()) - phases["forward"]) / sum(phases.values()),
        weight_mib=weight_bytes / 2**20,
        kv_mib=kv_bytes / 2**20,
        step_gflop=flops / 1e9,
        **limits,
        copy_bandwidth_gb_s=None if copy_bandwidth is None else copy_bandwidth / 1e9,
        read_once_ms=read_s * 1e3,
        flops_at_matmul_rate_ms=compute_s * 1e3,
        ideal_ms=ideal_s * 1e3,
        bound_by="memory" if read_s >= compute_s else "compute",
        step_over_ideal=step_s / ideal_s,
        native_decode=native_decode_used(engine),
        fused_decode=fused is not None,
        fused_breakdown_ms=fused_parts,
        breakdown_ms=breakdown,
        split_rows=fused is not None and fused.splits_rows(),
        split_rows_turns_ms=split_turns,
    )
    if not quiet:
        _print(result)
    return result


def start_decoding(
    model: str | None,
    dtype: str,
    num_seqs: int,
    context: int,
    steps: int,
    shared_prefix: int = 0,
    group_size: int = 1,
    share_reads: bool = True,
    device: str = "auto",
    llm=None,
    native_kernels: bool = True,
    kv_dtype: str = "auto",
):
    """An LLM whose engine holds num_seqs requests of `context` tokens, prefilled and one step into
    decode, each with room for `steps` more (llm: reuse one, its cache warm)."""
    from radixkv import LLM, SamplingParams

    if llm is None:
        pages = num_seqs * (-(-(context + steps + 8) // 16)) + 64
        llm = LLM(
            model, dtype=dtype, device=device, num_pages=pages, max_num_seqs=num_seqs, max_batch_tokens=4096,
            native_kernels=native_kernels, kv_dtype=kv_dtype,
        )  # fmt: skip
    engine = llm.engine
    engine.loaded.model.attention.share_reads = share_reads
    prompts = prompts_for(engine.model_config.vocab_size, num_seqs, context, shared_prefix, group_size)
    if shared_prefix:  # each group's prefix cached first, as a served system prompt would be
        llm.generate([p[:shared_prefix] for p in prompts[::group_size]], SamplingParams(max_tokens=1))
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 64, ignore_eos=True))
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.waiting) or engine.scheduler.waiting or any(
        s.num_uncomputed_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()
    engine.step_times.reset()
    return llm


def median_step_s(engine, steps: int) -> float:
    """The median of `steps` engine steps' wall times: a shared VM stalls a step now and then."""
    return statistics.median([_step_seconds(engine) for _ in range(steps)])


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


def fused_breakdown(engine, steps: int) -> dict[str, float]:
    """Where the fused step's time goes, in ms: the native call times its phases as it runs
    (FusedDecode.PHASES, all layers together), and what lies outside the decoder layers is
    timed part by part around its calls (OUTSIDE: the embedding, RoPE's tables, the attention
    backend's step tables, the fused call's own Python (with an MoE model's experts layers'
    routers and experts, which run between its calls), the final norm, the lm_head, the rest of
    the forward, then the engine's phases). Medians per part, so the parts need not add up to
    the median step."""
    model = engine.loaded.model
    fused = fused_decode(model)
    seconds = torch.zeros(len(fused.PHASES), dtype=torch.float64)
    totals: dict[str, float] = defaultdict(float)
    per_step = []
    fused.phase_seconds = seconds
    try:
        with ExitStack() as stack:
            for owner, name, label in (
                (type(model.embed_tokens), "forward", "embedding"),
                (type(model.rope), "__call__", "rope tables"),
                (type(model.attention), "begin_step", "attention step tables"),
                (type(fused), "run", "fused call"),
                (type(model.norm), "add_and_normalize", "final norm"),
                (type(model.lm_head), "forward", "lm_head"),
            ):
                stack.enter_context(_timed(owner, name, totals, label))
            for _ in range(steps):
                seconds.zero_()
                totals.clear()
                before = asdict(engine.step_times)
                start = time.perf_counter()
                engine.step()
                step = time.perf_counter() - start
                phases = {name: seconds - before[name] for name, seconds in asdict(engine.step_times).items()}
                parts = dict(zip(fused.PHASES, seconds.tolist(), strict=True))
                inside = sum(parts.values())
                parts["outside the layers"] = step - inside
                outside = {label: totals[label] for label in OUTSIDE[:6]}
                outside["fused call"] -= inside  # its Python around the native call
                outside["forward's rest"] = phases["forward"] - totals["fused call"] - sum(
                    v for k, v in outside.items() if k != "fused call")
                outside.update({f"engine: {phase}": phases[phase] for phase in ("schedule", "prepare", "sample", "postprocess")})
                outside["engine: between phases"] = step - sum(phases.values())
                parts.update({f"  {label}": outside[label] for label in OUTSIDE})
                per_step.append(parts)
    finally:
        fused.phase_seconds = None
    return _medians_ms(per_step)


# What fused_breakdown times outside the decoder layers, in the order a step runs it.
OUTSIDE = (
    "embedding", "rope tables", "attention step tables", "fused call", "final norm", "lm_head", "forward's rest",
    "engine: schedule", "engine: prepare", "engine: sample", "engine: postprocess", "engine: between phases",
)


def kernel_breakdown(engine, steps: int) -> dict[str, float]:
    """Where a decode step's time goes, in ms: the same steps run layer by layer (the fused
    call hides its parts from Python), each kernel timed around its call. The layer-by-layer
    step is itself reported, so the fused call's saving shows too."""
    from radixkv.cpu import decode, linear
    from radixkv.model import llama

    model = engine.loaded.model
    totals: dict[str, float] = defaultdict(float)
    fused, model.layers.fused = fused_decode(model), None
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
        model.layers.fused = fused
    return _medians_ms(per_step)


def _medians_ms(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each part's median over the steps, seconds to ms: a stalled step would skew a mean."""
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


SPLIT_TURNS = 6  # turns each of split rows on and off takes
SPLIT_TURN_STEPS = 3  # steps a turn; a turn's time is its fastest step's


def split_rows_in_turns(engine) -> dict[str, float]:
    """The fused step with each thread on its own rows ("on") and with every kernel's work
    split over the threads ("off"; EngineConfig.split_decode_rows), in turns over the same
    requests: median of each turn's fastest step, in ms. {} where no fused step runs."""
    fused = fused_decode(engine.loaded.model)
    if fused is None or torch.get_num_threads() < 2:
        return {}
    chosen, turns = fused.split_rows, {"on": [], "off": []}
    try:
        for _ in range(SPLIT_TURNS):
            for mode, times in turns.items():
                fused.split_rows = mode
                times.append(min(_step_seconds(engine) for _ in range(SPLIT_TURN_STEPS)))
    finally:
        fused.split_rows = chosen
    return {mode: statistics.median(times) * 1e3 for mode, times in turns.items()}


def _step_seconds(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def native_decode_used(engine) -> bool:
    """Whether decode reads the pages through the native kernel (the CPU backend, bf16 or fp32)."""
    capabilities = engine.loaded.model.attention.capabilities
    return capabilities.fused_cpu_decode and engine.dtype in (torch.bfloat16, torch.float32)


def _print(r: dict) -> None:
    print(f"\ndecode step, {r['num_seqs']} requests at {r['context']} tokens ({r['dtype']}, KV {r['kv_dtype']}, {r['torch_threads']} threads)")
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
    if r["fused_breakdown_ms"]:
        # Split by rows, the phases are the first thread's share's, each with the other beside it.
        whose = ", the first thread's rows" if r["split_rows"] else ""
        print(f"  where the fused step's time goes (timed inside the native call as it runs{whose}):")
        for part, ms in r["fused_breakdown_ms"].items():
            print(f"    {part:<26} {ms:8.1f} ms")
    print("  where the time goes (the same steps layer by layer, each kernel timed):")
    for part, ms in r["breakdown_ms"].items():
        print(f"    {part:<26} {ms:8.1f} ms")
    print(f"  engine's own work    {r['engine_overhead_fraction']:.1%} of the step")
    if r["split_rows_turns_ms"]:
        on, off = r["split_rows_turns_ms"]["on"], r["split_rows_turns_ms"]["off"]
        print(f"  rows split by thread {'yes' if r['split_rows'] else 'no'} (EngineConfig.split_decode_rows); in turns: "
              f"on {on:.1f} ms, off {off:.1f} ms, on / off {on / off:.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtype", default="auto", help="KV pages' storage dtype (EngineConfig.kv_dtype): auto, int8, ...")
    parser.add_argument("--num-seqs", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=1024, help="tokens of each request's prompt")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed")
    parser.add_argument("--out", default="out/decode_profile")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens the requests of a group share (0: none)")
    parser.add_argument("--own-tokens", type=int, default=64, help="with --shared-prefix: tokens of each request's own")
    parser.add_argument("--group-size", type=int, default=16, help="with --shared-prefix: requests per group")
    parser.add_argument("--group-sizes", default="1,2,4,8,16,32", help="with --shared-prefix: the sizes of the step-time sweep")
    parser.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                        help="with --shared-prefix: EngineConfig.batch_invariant (auto: on for quantized weights, which keeps every row on its own, cascade off)")  # fmt: skip
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.shared_prefix:
        return shared_prefix_main(args, out)
    result = profile_decode(args.model, args.dtype, args.num_seqs, args.context, args.steps, kv_dtype=args.kv_dtype)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode_profile_{result['dtype'].removeprefix('torch.')}.json"
    path.write_text(json.dumps(result, indent=2))
    _plot(result, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")
    return 0


def shared_prefix_main(args, out: Path) -> int:
    """Cascade decode on and off, same requests, same run; then step time against group size."""
    from radixkv import LLM

    context = args.shared_prefix + args.own_tokens
    pages = args.num_seqs * (-(-(context + args.steps + 72) // 16)) + 64
    invariant = {"auto": None, "on": True, "off": False}[args.batch_invariant]
    llm = LLM(args.model, dtype=args.dtype, num_pages=pages, max_num_seqs=args.num_seqs, max_batch_tokens=4096, batch_invariant=invariant)
    common = dict(num_seqs=args.num_seqs, context=context, steps=args.steps, shared_prefix=args.shared_prefix, quiet=True,
                  llm=llm, limits=machine_limits(llm.engine.dtype))  # fmt: skip
    runs = {share: profile_decode(**common, group_size=args.group_size, share_reads=share, breakdown=True) for share in (True, False)}
    sweep = [
        {share: profile_decode(**common, group_size=size, share_reads=share) for share in (True, False)}
        for size in (int(s) for s in args.group_sizes.split(","))
    ]
    on, off = runs[True], runs[False]
    print(f"\ndecode step, {args.num_seqs} requests in groups of {args.group_size} over a {args.shared_prefix}-token shared "
          f"prefix + {args.own_tokens} own tokens ({on['dtype']}) on {on['cpu']}")  # fmt: skip
    print(f"  read {on['read_bandwidth_gb_s']:.1f} GB/s, {on['matmul_dtype']} matmul {on['matmul_gflops']:.0f} GFLOP/s")
    print(f"  {'cascade':<9}{'step ms':>9}{'attention ms':>14}{'KV fetched/step':>17}{'/ unique KV':>13}{'x bound':>9}")
    attention = "attention (paged decode)"
    for name, r in (("on", on), ("off", off)):
        fetched = r["kv_tokens_fetched_per_step"]
        print(f"  {name:<9}{r['step_ms']:>9.1f}{r['breakdown_ms'][attention]:>14.1f}{fetched:>17.0f}"
              f"{fetched / r['kv_tokens_unique_per_step']:>13.2f}{r['step_over_ideal']:>9.2f}")  # fmt: skip
    print(f"  off / on: step {off['step_ms'] / on['step_ms']:.2f}x, attention "
          f"{off['breakdown_ms'][attention] / on['breakdown_ms'][attention]:.2f}x; "
          f"bound (unique KV read once) {on['ideal_ms']:.1f} ms ({on['bound_by']})")  # fmt: skip
    print(f"\n  {'group size':<12}{'on ms':>9}{'off ms':>9}{'off/on':>8}")
    for size, pair in zip(args.group_sizes.split(","), sweep, strict=True):
        print(f"  {size:<12}{pair[True]['step_ms']:>9.1f}{pair[False]['step_ms']:>9.1f}{pair[False]['step_ms'] / pair[True]['step_ms']:>8.2f}")
    path = out / "decode_profile_shared_prefix.json"
    path.write_text(json.dumps(dict(on=on, off=off, sweep=[{"on": p[True], "off": p[False]} for p in sweep]), indent=2))
    _plot_sweep(sweep, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")
    return 0


def _plot_sweep(sweep: list[dict], path: Path) -> None:
    plt = pyplot()

    sizes = [pair[True]["group_size"] for pair in sweep]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(sizes, [p[True]["step_ms"] for p in sweep], "o-", label="cascade on")
    ax.plot(sizes, [p[False]["step_ms"] for p in sweep], "s--", label="off")
    ax.plot(sizes, [p[True]["ideal_ms"] for p in sweep], ":", color="gray", label="bound (unique KV once)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests per shared prefix")
    ax.set_ylabel("decode step ms")
    ax.set_title(f"{sweep[0][True]['num_seqs']} requests, {sweep[0][True]['shared_prefix']}-token prefixes — {sweep[0][True]['cpu']}", fontsize=8)
    ax.legend(fontsize=8)
    save(fig, path)


def _plot(r: dict, path: Path) -> None:
    plt = pyplot()

    runs = {"layer by layer": {k: v for k, v in r["breakdown_ms"].items() if not k.startswith("step")}}
    if r["fused_breakdown_ms"]:
        runs["fused, by phase"] = r["fused_breakdown_ms"]
    fig, ax = plt.subplots(figsize=(9, 3.5 + 0.5 * len(runs)))
    ax.barh(["step (as run)", "bound"], [r["step_ms"], r["ideal_ms"]], color=["tab:blue", "tab:gray"])
    labels = list(dict.fromkeys(name for parts in runs.values() for name in parts))
    for row, parts in runs.items():
        left = 0.0
        for name, ms in parts.items():
            ax.barh([row], [max(ms, 0.0)], left=left, label=name, color=plt.cm.tab20(labels.index(name) % 20))
            left += max(ms, 0.0)
    ax.set_xlabel("ms")
    ax.set_title(f"decode step, {r['num_seqs']} x {r['context']} tokens, {r['dtype']} — {r['cpu']}", fontsize=8)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
