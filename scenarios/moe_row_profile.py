"""The Python around a mixture-of-experts layer at one token (a decode step's experts layer under
the fused step): each experts layer's wall time against its native calls, timed as they run.

    python -m radixkv.scenarios.moe_row_profile --model FILE.gguf [--threads 1 --calls 200]

Per experts layer, `calls` calls of the fused step's callback into the layer on one random
hidden state; the router's and the two expert kernels' entry points wrapped so each call notes
when it began and ended. Python = the call's wall time less its kernels', per call, so the
kernels' own spread on a loaded machine stays out of it; the gaps between the kernels say where.
The wrappers' own cost (two clock reads a kernel) counts as Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from radixkv.model.moe import MappedExperts, SparseMoE
from radixkv.scenarios.machine import machine_limits


class _Clock:
    """Wraps native entry points so each call notes when it began and ended."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def wrap(self, fn):
        marks, clock = self.marks, time.perf_counter

        def timed(*args):
            begin = clock()
            try:
                return fn(*args)
            finally:
                marks.append((begin, clock()))

        return timed


# The gaps around a layer's two native calls (the router, the experts), in the order they run.
GAPS = ("into the router kernel", "router to the experts: route, dispatch", "experts to return")


def profile_layer(model, library, index: int, h: torch.Tensor, calls: int) -> dict[str, float]:
    """Median us per call over `calls` calls of the fused step's callback into experts layer
    `index` (as FusedDecodeLayers hands it over): wall, the two kernels, and the gaps around them."""
    meta = SimpleNamespace(batch_invariant=False)
    layers = model.layers
    moe = layers[index].mlp
    clock = _Clock()
    originals = {name: getattr(library, name) for name in ("radixkv_moe_token",)}
    router_run = moe.gate._run
    try:
        for name, fn in originals.items():
            setattr(library, name, clock.wrap(fn))
        moe.gate._run = clock.wrap(router_run)
        moe.experts._row = None  # one_token's calls rebuilt over the wrapped entry points
        callback = lambda i, x: layers[i].mlp(x, meta)  # noqa: E731
        rows = []
        for _ in range(calls + 3):  # the first calls warm up
            clock.marks.clear()
            begin = time.perf_counter()
            callback(index, h)
            end = time.perf_counter()
            assert len(clock.marks) == 2, "an experts layer at one token makes two native calls"
            edges = [begin, *(t for mark in clock.marks for t in mark), end]
            gaps = [edges[2 * i + 1] - edges[2 * i] for i in range(len(GAPS))]
            rows.append(dict(wall=end - begin, kernels=sum(e - b for b, e in clock.marks), **dict(zip(GAPS, gaps, strict=True))))
    finally:
        for name, fn in originals.items():
            setattr(library, name, fn)
        moe.gate._run = router_run
        moe.experts._row = None
    rows = rows[3:]
    us = {name: statistics.median(row[name] for row in rows) * 1e6 for name in rows[0]}
    us["python"] = statistics.median((row["wall"] - row["kernels"]) for row in rows) * 1e6
    return us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a mixture-of-experts GGUF (Qwen3-MoE)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200, help="calls timed per layer")
    parser.add_argument("--limits", type=int, default=1, help="0: skip measuring the machine's limits (tests)")
    parser.add_argument("--out", default="out/moe_row_profile")
    args = parser.parse_args(argv)

    from radixkv import LLM
    from radixkv.cpu import native

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_pages=8, moe_kernel="native")
    model, dtype, library = llm.engine.loaded.model, llm.engine.dtype, native.load()
    layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE) and isinstance(layer.mlp.experts, MappedExperts)]
    if not layers:
        parser.error(f"{args.model} has no experts layers read in place")
    if not all(model.layers[i].mlp.gate.rows_independent for i in layers):  # the router on torch's linear
        wanted = "avx512_bf16 or amx_bf16" if dtype == torch.bfloat16 else "avx2"
        parser.error(f"the routers' linear runs no native kernel in {dtype} on this CPU (it needs {wanted}): nothing to time")
    generator = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    per_layer = {}
    for i in layers:
        h = torch.randn(1, hidden, generator=generator).to(dtype)
        per_layer[i] = profile_layer(model, library, i, h, args.calls)
    mean = {part: statistics.fmean(us[part] for us in per_layer.values()) for part in per_layer[layers[0]]}
    result = dict(model=args.model, dtype=str(dtype).removeprefix("torch."), threads=args.threads, layers=len(layers),
                  mean_us=mean, per_layer_us=per_layer, **(machine_limits(dtype) if args.limits else {}))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_row_profile.json").write_text(json.dumps(result, indent=1))
    print(f"{len(layers)} experts layers, {result['dtype']}, {args.threads} thread(s)")
    if args.limits:
        print(f"  {result['cpu']}: read {result['read_bandwidth_gb_s']:.1f} GB/s, matmul {result['matmul_gflops']:.0f} GFLOP/s (this run)")
    print("  per layer, us (mean of the layers' medians; python = wall less the kernels, per call):")
    for part, us in mean.items():
        print(f"    {part:<15} {us:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
