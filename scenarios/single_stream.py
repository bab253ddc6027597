"""Single stream on one GGUF: one request (a prompt of --prompt-len tokens, --output-len tokens
out, greedy) through radixkv in process, `radixkv serve` over HTTP and llama.cpp's llama-server
over HTTP on the same file: prefill time, decode seconds per token, and the peak RSS of a
radixkv process loading the file with a small KV pool.

    python -m radixkv.scenarios.single_stream [--model FILE.gguf] [--prompt-len 512 --output-len 128]
        [--peers radixkv,radixkv-serve,llama-server] [--weight-dtype auto --kv-dtype bf16 --quant-kernel ... --moe-kernel ...]
        [--fused-decode both --repeats 3]

The prompt's token ids come from the model's own tokenizer (any GGUF radixkv reads: a dense,
mixture-of-experts or Gemma 3 one, e.g. real_shape's), sent as ids to both servers so both
compute the same tokens. Each server gets one short request first,
off the clock. --weight-dtype/--kv-dtype/--quant-kernel/--moe-kernel reach EngineConfig and `radixkv serve`
when this checkout has them (a line says when one is ignored). --fused-decode 0 runs the
in-process peer's decode steps module by module (the fused native step off, as the tests switch
it); "both" times its request each way in turn, --repeats times, on one loaded model (the best
of each kept, and whether both gave the same tokens): an A/B of the two paths on a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS = ("radixkv", "radixkv-serve", "llama-server")
WARMUP_IDS = [(7 * i) % 200 + 10 for i in range(24)]  # unlike any prompt, so nothing is cached


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf (or HF folder: no llama-server then); default SmolLM2's GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--num-pages", type=int, default=None, help="radixkv's KV pages; default: what the request needs plus 16")
    parser.add_argument("--threads", type=int, default=2, help="threads of every peer (llama-server's -t, radixkv's torch threads)")
    parser.add_argument("--weight-dtype", default=None)
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--quant-kernel", default=None)
    parser.add_argument("--moe-kernel", default=None, help="EngineConfig.moe_kernel (a mixture-of-experts model's experts)")
    parser.add_argument("--fused-decode", choices=("1", "0", "both"), default="1", help="0: the in-process peer decodes module by module; both: each in turn")
    parser.add_argument("--repeats", type=int, default=1, help="times the in-process peer's request is timed each way (the best kept)")
    parser.add_argument("--limits", type=int, default=1, help="0: skip measuring the machine's limits (tests)")
    parser.add_argument("--out", default="out/single_stream")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the in-process peer's own process
    args = parser.parse_args(argv)
    unknown = [p for p in args.peers.split(",") if p not in PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    return args


def model_path(args: argparse.Namespace) -> str:
    from radixkv.model.loader import default_model_gguf

    return args.model or str(default_model_gguf())


def prompt_ids(length: int, model: str | None = None) -> list[int]:
    """`length` ids of English text in the model's own tokenizer (ids of another tokenizer may
    lie past a small vocabulary's end)."""
    from radixkv.scenarios.harness import load_tokenizer, text_tokens

    return text_tokens(load_tokenizer(model), length, offset=11)


def knobs(args: argparse.Namespace) -> dict[str, str]:
    from radixkv.scenarios.serve_http import engine_knobs

    return engine_knobs(_knob_values(args))


def _knob_values(args: argparse.Namespace) -> dict[str, str | None]:
    return dict(weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, quant_kernel=args.quant_kernel, moe_kernel=args.moe_kernel)


def num_pages(args: argparse.Namespace, page_size: int = 16) -> int:
    return args.num_pages or -(-(args.prompt_len + args.output_len) // page_size) + 16


# -- radixkv in process (run in its own process, so its RSS is its own) ----------------------


def run_in_process(args: argparse.Namespace, ids: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps(dict(ids=ids, result=str(result))))
        command = [sys.executable, "-m", "radixkv.scenarios.single_stream", *_child_argv(args), "--child", str(spec)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            return dict(peer="radixkv", error=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
        return json.loads(result.read_text())


def _child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", model_path(args), "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--num-pages", str(num_pages(args)), "--threads", str(args.threads),
            "--fused-decode", args.fused_decode, "--repeats", str(args.repeats)]  # fmt: skip
    for name in ("weight_dtype", "kv_dtype", "quant_kernel", "moe_kernel"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), getattr(args, name)]
    return argv


def child(args: argparse.Namespace) -> int:
    """The in-process peer: load, note the peak RSS, time one request (each way, --repeats times)."""
    import torch

    from radixkv import LLM, SamplingParams
    from radixkv.model.fused_layers import fused_decode
    from radixkv.scenarios.machine import process_memory

    spec = json.loads(Path(args.child).read_text())
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(model_path(args), dtype=args.dtype, num_pages=num_pages(args), **knobs(args))
    load_s = time.perf_counter() - start
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child's would
    # be at least its parent's peak (this scenario's, which measured the machine's limits).
    load_peak = process_memory()["peak_rss_bytes"]
    model = llm.engine.loaded.model
    plan = fused_decode(model)
    ways = {"1": [True], "0": [False], "both": [True, False]}[args.fused_decode]
    llm.generate([WARMUP_IDS], SamplingParams(max_tokens=2, ignore_eos=True))
    runs: dict[bool, list] = {way: [] for way in ways}  # (decode s/token, wall, output) per run
    for _ in range(args.repeats):
        for way in ways:
            model.layers.fused = plan if way else None  # off: the layer loop, as the tests switch it
            start = time.perf_counter()
            [output] = llm.generate([spec["ids"]], SamplingParams(max_tokens=args.output_len, ignore_eos=True))
            wall = time.perf_counter() - start
            n, ttft = len(output.token_ids), output.time_to_first_token_s
            runs[way].append(((wall - ttft) / (n - 1) if n > 1 else None, wall, output))
    model.layers.fused = plan
    # The first request's prefill (later ones find the prompt cached); the best decode each way.
    first = runs[ways[0]][0][2]
    decode_s, wall, output = min(runs[ways[0]], key=lambda run: run[0] or 0.0)
    n = len(output.token_ids)
    row = dict(
        peer="radixkv", error=None, load_s=load_s, prefill_s=first.time_to_first_token_s, decode_s_per_token=decode_s,
        output_tokens=n, wall_s=wall, load_peak_rss_bytes=load_peak,
        **process_memory(),
        kv_pages=llm.engine.pool.num_pages, fused_decode=plan is not None and ways[0], dtype=str(llm.engine.dtype).removeprefix("torch."),
        token_ids=list(output.token_ids),
    )  # fmt: skip
    if len(ways) == 2:
        row["module_decode_s_per_token"] = min(run[0] or 0.0 for run in runs[False])
        row["same_tokens_both_ways"] = len({tuple(run[2].token_ids) for way in ways for run in runs[way]}) == 1
    Path(spec["result"]).write_text(json.dumps(row))
    return 0


# -- the servers over HTTP -------------------------------------------------------------------


def run_server(peer: str, args: argparse.Namespace, ids: list[int], out: Path) -> dict:
    from radixkv.scenarios.llama_server import LlamaServerOptions, start_llama_server
    from radixkv.scenarios.serve_http import start_radixkv_serve

    model = model_path(args)
    start = time.perf_counter()
    try:
        if peer == "llama-server":
            options = LlamaServerOptions(slots=1, ctx_per_slot=args.prompt_len + args.output_len + 64, threads=args.threads)
            server = start_llama_server(Path(model), out / "llama-server.log", options)
        else:
            server = start_radixkv_serve(
                model, out / "radixkv-serve.log", dtype=args.dtype, num_pages=num_pages(args), threads=args.threads, knobs=knobs(args)
            )
    except Exception as error:  # a peer that cannot start is reported, and the others still run
        return dict(peer=peer, error=f"{type(error).__name__}: {error}")
    load_s = time.perf_counter() - start
    with server:
        load_memory = server.memory()
        reply = asyncio.run(_one_request(server, ids, args.output_len))
        memory = server.memory()
    if reply.error:
        return dict(peer=peer, error=reply.error)
    return dict(
        peer=peer, error=None, load_s=load_s, prefill_s=reply.ttft_s, decode_s_per_token=reply.decode_s_per_token,
        output_tokens=reply.completion_tokens, wall_s=reply.wall_s, load_peak_rss_bytes=load_memory["peak_rss_bytes"],
        peak_rss_bytes=memory["peak_rss_bytes"], rss_bytes=memory["rss_bytes"], prompt_tokens=reply.prompt_tokens,
        cached_tokens=reply.cached_tokens,
    )  # fmt: skip


async def _one_request(server, ids: list[int], output_len: int):
    import httpx

    from radixkv.scenarios.serve_http import stream

    body = dict(max_tokens=output_len, temperature=0, ignore_eos=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        await stream(client, server, "/v1/completions", dict(body, prompt=WARMUP_IDS, max_tokens=2))
        return await stream(client, server, "/v1/completions", dict(body, prompt=ids))


# -- report ----------------------------------------------------------------------------------


def print_table(rows: list[dict], args: argparse.Namespace, limits: dict | None) -> None:
    print(f"\nsingle_stream: {model_path(args)}, {args.prompt_len} prompt tokens, {args.output_len} out, greedy, {args.threads} threads")
    if limits:
        print(f"{limits['cpu']}: read {limits['read_bandwidth_gb_s']:.1f} GB/s, {limits['matmul_dtype']} matmul {limits['matmul_gflops']:.0f} GFLOP/s (this run)")
    header = f"{'peer':<16}{'load s':>8}{'prefill s':>10}{'prompt tok/s':>13}{'decode s/tok':>13}{'x llama':>8}{'out':>5}{'load peak GB':>13}{'peak GB':>9}{'RSS GB':>8}"
    print(header)
    print("-" * len(header))
    llama = next((r for r in rows if r["peer"] == "llama-server" and not r.get("error")), None)
    for row in rows:
        if row.get("error"):
            print(f"{row['peer']:<16} failed: {row['error'].splitlines()[-1][:100]}")
            continue
        ratio = row["decode_s_per_token"] / llama["decode_s_per_token"] if llama and row["decode_s_per_token"] and llama["decode_s_per_token"] else None
        row["decode_ratio_vs_llama_server"] = ratio
        print(
            f"{row['peer']:<16}{row['load_s']:>8.1f}{row['prefill_s']:>10.2f}{args.prompt_len / row['prefill_s']:>13.1f}"
            f"{row['decode_s_per_token'] or 0:>13.4f}{'-' if ratio is None else f'{ratio:.2f}':>8}{row['output_tokens']:>5}"
            f"{row['load_peak_rss_bytes'] / 1e9:>13.2f}{row['peak_rss_bytes'] / 1e9:>9.2f}{row['rss_bytes'] / 1e9:>8.2f}"
        )
        if "fused_decode" in row:
            print(f"{'':<16}decode steps: {'the fused native step' if row['fused_decode'] else 'module by module'}")
        if "module_decode_s_per_token" in row:
            print(f"{'':<16}module by module: {row['module_decode_s_per_token']:.4f} s/tok (best of {args.repeats} each way, in turn); "
                  f"same tokens both ways: {row['same_tokens_both_ways']}")


def plot(rows: list[dict], path: Path) -> None:
    from radixkv.scenarios.plots import pyplot, save

    plt = pyplot()
    ok = [r for r in rows if not r.get("error")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [r["peer"] for r in ok]
    for ax, key, title in zip(axes, ("prefill_s", "decode_s_per_token", "load_peak_rss_bytes"), ("prefill s", "decode s / token", "peak RSS loading (bytes)")):
        ax.bar(names, [r[key] or 0 for r in ok])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers = args.peers.split(",")
    model = model_path(args)
    if "llama-server" in peers and not model.endswith(".gguf"):
        print("note: llama-server needs a .gguf; left out", flush=True)
        peers.remove("llama-server")
    ids = prompt_ids(args.prompt_len, model)
    rows = []
    for peer in peers:
        print(f"running {peer} ...", flush=True)
        rows.append(run_in_process(args, ids) if peer == "radixkv" else run_server(peer, args, ids, out))
    limits = None
    if args.limits:
        import torch

        from radixkv.scenarios.machine import machine_limits

        torch.set_num_threads(args.threads)  # the limits at the threads the peers ran with
        dtype = next((getattr(torch, r["dtype"]) for r in rows if r.get("dtype")), torch.float32)
        limits = machine_limits(dtype)  # after the peers: nothing else of ours is running
    print_table(rows, args, limits)
    results = dict(
        scenario="single_stream", model=model, prompt_len=args.prompt_len, output_len=args.output_len, threads=args.threads,
        knobs=_knob_values(args),
        machine_limits=limits, command=" ".join(["python -m radixkv.scenarios.single_stream", *(argv if argv is not None else sys.argv[1:])]),
        rows=[{k: v for k, v in r.items() if k != "token_ids"} for r in rows],
    )  # fmt: skip
    from radixkv.scenarios.plots import save_results

    save_results(out, "single_stream", results, lambda path: plot(rows, path))
    return 0 if all(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
