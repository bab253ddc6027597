"""The quantized linears' kernels timed against each other in one process, on the default model
(SmolLM2-135M Q4_1): main's build with quant_kernel="auto" beside this tree's kernels.

Each kernel gets its own engine over the same GGUF (main's under main's library, built from its
sources as scenarios/native_ab.py does). Two parts, each in turns with the order alternating:
- the step's linears: every QuantLinear of the model (the tied lm_head included) on 1 and 32
  rows, their outputs compared bit for bit against the first kernel's;
- the whole decode step: 32 requests at ~1k tokens each, prefilled, then one step per kernel per
  round (the fused native layer loop where it runs).
Reported: the best (min) per kernel and the ratio of the sums of the mins against the first,
with the machine's limits (scenarios/machine.py) measured before and after.

    python -m radixkv.scenarios.quant_ab [--base main] [--kernels main:auto,tree:avx2,tree:avx512_vnni_zmm]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from radixkv.cpu import native
from radixkv.cpu.quant_linear import QuantLinear
from radixkv.scenarios.decode_profile import start_decoding
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.native_ab import sources_at


def quant_layers(llm) -> list[QuantLinear]:
    return [m for m in llm.engine.loaded.model.modules() if isinstance(m, QuantLinear)]


def run_in_turns(names: list[str], libraries: dict, run, rounds: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds):
        for name in names[:: 1 if turn % 2 == 0 else -1]:
            with native.using(libraries[name]):
                start = time.perf_counter()
                run(name)
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="git revision whose library runs the 'main:' kernels")
    parser.add_argument("--kernels", default="main:auto,tree:avx2,tree:avx512_vnni,tree:avx512_vnni_zmm")
    parser.add_argument("--step-kernels", default="main:auto,tree:avx2,tree:avx512_vnni_zmm", help="those also timed on the whole step")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M Q4_1 GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default="out/quant_ab")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.kernels.split(",")
    step_names = [n for n in args.step_kernels.split(",") if n]
    tree = native.load()
    libraries = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = native.build_from(sources_at(args.base, Path(tmp)), native.find_compiler()) if any(n.startswith("main:") for n in names) else None
        for name in names:
            libraries[name] = base if name.startswith("main:") else tree
    limits_before = machine_limits(torch.bfloat16)

    from radixkv import LLM

    pages = args.num_seqs * (-(-(args.context + args.rounds + 8) // 16)) + 64
    llms = {}
    for name in names:
        with native.using(libraries[name]):
            llms[name] = LLM(
                args.model, dtype=args.dtype, quant_kernel=name.split(":", 1)[1], num_pages=pages,
                max_num_seqs=args.num_seqs, max_batch_tokens=4096,
            )  # fmt: skip
        print(name, "->", quant_layers(llms[name])[0].kernel, flush=True)
    dtype = llms[names[0]].engine.dtype

    results: dict = dict(kernels=names, threads=args.threads, dtype=str(dtype), limits_before=limits_before, linears={})
    for rows in (1, args.num_seqs):
        inputs = {layer.in_features: torch.randn(rows, layer.in_features).to(dtype) for layer in quant_layers(llms[names[0]])}
        outputs: dict[str, list[torch.Tensor]] = {}

        def linears(name: str) -> None:
            outputs[name] = [layer(inputs[layer.in_features]) for layer in quant_layers(llms[name])]

        seconds = run_in_turns(names, libraries, linears, args.rounds)
        best = {name: min(times) * 1e3 for name, times in seconds.items()}
        identical = all(all(map(torch.equal, out, outputs[names[0]])) for out in outputs.values())
        results["linears"][rows] = dict(best_ms=best, identical=identical)
        print(f"linears, {rows} rows: " + ", ".join(f"{n} {ms:.2f} ms ({best[names[0]] / ms:.2f}x)" for n, ms in best.items()) + f"; bit-identical {identical}", flush=True)

    if step_names:
        for name in step_names:
            with native.using(libraries[name]):
                start_decoding(args.model, args.dtype, args.num_seqs, args.context, args.rounds, llm=llms[name])
        seconds = run_in_turns(step_names, libraries, lambda name: llms[name].engine.step(), args.rounds)
        best = {name: min(times) * 1e3 for name, times in seconds.items()}
        results["step"] = dict(best_ms=best, num_seqs=args.num_seqs, context=args.context)
        print(f"decode step, {args.num_seqs} x {args.context}: " + ", ".join(f"{n} {ms:.1f} ms ({best[step_names[0]] / ms:.2f}x)" for n, ms in best.items()), flush=True)
    results["limits_after"] = machine_limits(torch.bfloat16)
    for key in ("limits_before", "limits_after"):
        lim = results[key]
        print(f"{key}: {lim['cpu']}, {lim['torch_threads']} threads, read {lim['read_bandwidth_gb_s']:.1f} GB/s, bf16 matmul {lim['matmul_gflops']:.0f} GFLOP/s")
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "quant_ab.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {folder / 'quant_ab.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
