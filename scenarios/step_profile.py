"""Where a decode step's time goes on any device, by torch's profiler: the step's wall time, the
time the device spends in kernels, how many kernels one step launches, and the operators that
cost the most on the host and on the device. On a GPU it tells a launch-bound step (device busy
for a small part of the wall time) from a kernel-bound one.

    python -m radixkv.scenarios.step_profile [--num-seqs 32 --context 1024 --steps 8 --device auto]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from radixkv.scenarios.decode_profile import start_decoding
from radixkv.scenarios.plots import pyplot, save, save_results

TOP_OPS = 12


def profile_steps(engine, steps: int) -> dict:
    """The median wall time of `steps` decode steps, then the same number under the profiler."""
    device = engine.device
    wall = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # the sampled tokens come back to the host: each step ends synchronized
        wall.append(time.perf_counter() - start)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            engine.step()
    events = profiler.key_averages()
    on_device = [e for e in events if _device_us(e) > 0] if device.type == "cuda" else []
    return dict(
        device=str(device),
        step_ms=sorted(wall)[len(wall) // 2] * 1e3,
        # The rest of the host's time is Python and native calls the profiler does not see.
        host_ops_ms_per_step=sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
        device_busy_ms_per_step=sum(_device_us(e) for e in on_device) / 1e3 / steps,
        kernels_per_step=sum(e.count for e in on_device if e.device_type == torch.autograd.DeviceType.CUDA) / steps,
        top_host_ops=_top(events, lambda e: e.self_cpu_time_total, steps),
        top_device_ops=_top(on_device, _device_us, steps),
    )


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", 0.0) or 0.0


def _top(events, cost, steps: int) -> list[dict]:
    ranked = sorted(events, key=cost, reverse=True)[:TOP_OPS]
    return [{"name": e.key, "ms_per_step": cost(e) / 1e3 / steps, "calls_per_step": e.count / steps} for e in ranked]


def _print(r: dict) -> None:
    kernels = "radixkv's kernels" if r["native_kernels"] else "torch ops (native_kernels=False)"
    print(f"\ndecode step, {r['num_seqs']} requests at {r['context']} tokens ({r['dtype']} on {r['device']}, {kernels})")
    print(f"  step time            {r['step_ms']:8.2f} ms (median, unprofiled)")
    print(f"  host in torch ops    {r['host_ops_ms_per_step']:8.2f} ms a step (the rest: Python, native calls, waiting)")
    if r["device"].startswith("cuda"):
        busy = r["device_busy_ms_per_step"]
        print(f"  device in kernels    {busy:8.2f} ms a step ({busy / r['step_ms']:.0%} of the step)")
        print(f"  kernels launched     {r['kernels_per_step']:8.0f} a step")
    for title, key in (("host", "top_host_ops"), ("device", "top_device_ops")):
        if r[key]:
            print(f"  top operators by {title} time (ms a step, calls a step):")
            for op in r[key]:
                print(f"    {op['name'][:48]:<48} {op['ms_per_step']:8.3f} {op['calls_per_step']:7.0f}")


def _plot(r: dict, path: Path) -> None:
    plt = pyplot()
    rows = [("host", r["top_host_ops"])] + ([("device", r["top_device_ops"])] if r["top_device_ops"] else [])
    fig, axes = plt.subplots(1, len(rows), figsize=(7 * len(rows), 4.5), squeeze=False)
    for ax, (title, ops) in zip(axes[0], rows):
        ax.barh([op["name"][:32] for op in ops][::-1], [op["ms_per_step"] for op in ops][::-1])
        ax.set_xlabel("ms a step")
        ax.set_title(f"top operators by {title} time")
    fig.suptitle(f"decode step {r['step_ms']:.1f} ms, {r['num_seqs']} x {r['context']} tokens on {r['device']}")
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:N]")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-native", action="store_true", help="torch ops for what radixkv's own kernels do (native_kernels=False)")
    parser.add_argument("--out", default="out/step_profile")
    args = parser.parse_args(argv)
    llm = start_decoding(
        args.model, args.dtype, args.num_seqs, args.context, 2 * args.steps, device=args.device,
        native_kernels=not args.no_native,
    )  # fmt: skip
    engine = llm.engine
    result = dict(
        num_seqs=args.num_seqs, context=args.context, dtype=str(engine.dtype), native_kernels=not args.no_native,
        **profile_steps(engine, args.steps),
    )  # fmt: skip
    engine.abort_all()
    _print(result)
    save_results(args.out, "step_profile", result, lambda path: _plot(result, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
