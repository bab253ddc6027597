"""The agent workload at real length over HTTP: --sessions concurrent sessions over --prompts
agent prompts of --prompt-tokens tokens (system prompt and tool schemas), --turns turns each (a
user message, a --reply-tokens greedy reply, the reply appended to the history for the next
turn), streamed from `radixkv serve` and from llama.cpp's llama-server (-np sessions, with and
without -kvu: the better one is compared) on the same GGUF.

    python -m radixkv.scenarios.agent_sessions [--model FILE.gguf] [--sessions 16 --prompts 4
        --prompt-tokens 8192 --turns 4 --reply-tokens 128] [--servers radixkv,llama-server,llama-server-kvu]
        [--api auto|chat|completions] [--llama-slots N] [--moe-kernel K --kv-dtype D --num-pages N]

Prompt lengths are counted in the model's own tokens. A model with a chat template is sent chat
requests; one without (a base model's GGUF, as Gemma 3 270M's) gets the same conversation rendered
as plain text to /v1/completions (--api). radixkv's KV pool is sized from free memory less the
experts it reads in place from the file, unless --num-pages; --llama-slots caps llama-server's
slots (default one a session), the rest of the sessions queueing there, when its KV for one slot a
session would not fit in memory beside the model.

Replies are asked for with ignore_eos (both servers honour it), so both make the same tokens.
With --peer-time-factor F, radixkv runs first and each llama-server stops at F times radixkv's
wall time: a peer that has not finished by then is slower than F times in throughput over the
same work (a bound, printed as "> F"), and its p90 time to first token is bounded from below by
counting a turn still waiting for its first token as waiting until the stop (never sent: 0 s).
Reports per turn time to first token p50/p90, output tokens/s over the run, the server's RSS,
its cached share of prompt tokens (the usage's prompt_tokens_details.cached_tokens, else
radixkv's /metrics), wall time, the ratios radixkv / llama-server, and an estimate of the full
size's wall time from this run's prefill and decode shares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from radixkv.scenarios.agent_tools import QUESTIONS
from radixkv.scenarios.report import percentile

SERVERS = ("radixkv", "llama-server", "llama-server-kvu")
FULL = dict(sessions=16, prompts=4, prompt_tokens=8192, turns=4, reply_tokens=128)
API_MODES = ("auto", "chat", "completions")
TOOL_NAMES = ("lookup_order", "search_docs", "calculator", "calendar", "convert_currency", "weather")


@dataclass(slots=True)
class Turn:
    """One turn of one session, as the server streamed it."""

    session: int
    turn: int
    start_s: float  # from the run's start
    ttft_s: float | None
    wall_s: float
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int  # a turn cut off at the deadline: the token events it streamed
    error: str | None
    finished: bool = True  # False: cut off at the run's deadline (--peer-time-factor)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf (llama-server needs one); default SmolLM2's GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--servers", default="radixkv,llama-server,llama-server-kvu")
    for name, value in FULL.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-pages", type=int, default=None, help="radixkv's KV pages; default: sized from memory")
    parser.add_argument("--cache-ram-mib", type=int, default=8192, help="llama-server's --cache-ram")
    parser.add_argument("--weight-dtype", default=None)
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--quant-kernel", default=None)
    parser.add_argument("--moe-kernel", default=None, help="EngineConfig.moe_kernel (a mixture-of-experts model's experts)")
    parser.add_argument("--api", default="auto", choices=API_MODES, help="auto: chat when the model has a chat template, else completions")
    parser.add_argument("--llama-slots", type=int, default=0, help="llama-server's -np (0: one a session)")
    parser.add_argument("--request-timeout-s", type=float, default=7200.0)
    parser.add_argument("--peer-time-factor", type=float, default=0.0, help="stop each llama-server at this many times radixkv's wall (0: run to the end)")
    parser.add_argument("--limits", type=int, default=1, help="0: skip measuring the machine's limits (tests)")
    parser.add_argument("--out", default="out/agent_sessions")
    args = parser.parse_args(argv)
    unknown = [s for s in args.servers.split(",") if s not in SERVERS]
    if unknown:
        parser.error(f"unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
    for name in FULL:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.llama_slots < 0:
        parser.error("--llama-slots must be at least 0")
    return args


# -- the workload ----------------------------------------------------------------------------


def tool_schemas(prompt: int) -> str:
    """The tools' JSON schemas as an agent framework puts them in its system prompt."""
    tools = [
        {"type": "function", "function": {"name": f"{name}_{prompt}", "description": f"Tool {name} of agent {prompt}.",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}}
        for name in TOOL_NAMES
    ]  # fmt: skip
    return json.dumps(tools)


def system_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` distinct agent system prompts of about `tokens` tokens each: a header, the tool
    schemas, then instructions (the harness's text) filling the rest."""
    from radixkv.scenarios.harness import text_tokens

    prompts = []
    for p in range(count):
        head = f"You are agent {p} of the support team. Tools:\n{tool_schemas(p)}\nInstructions:\n"
        room = max(0, tokens - len(tokenizer(head, add_special_tokens=False).input_ids))
        prompts.append(head + tokenizer.decode(text_tokens(tokenizer, room, offset=97 * p)))
    return prompts


def user_message(session: int, turn: int) -> str:
    return f"[session {session}, turn {turn}] {QUESTIONS[(session + turn) % len(QUESTIONS)]}"


def api_mode(requested: str, tokenizer) -> str:
    """chat or completions: auto takes chat where the model's tokenizer has a chat template."""
    if requested != "auto":
        return requested
    return "chat" if getattr(tokenizer, "chat_template", None) else "completions"


def render_plain(messages: list[dict]) -> str:
    """A conversation as plain text, for a model without a chat template: the system prompt,
    then "User: ..." and "Assistant: ..." turns, open for the assistant's next reply. Plain
    text, so both servers tokenize it the same way (no special tokens to parse)."""
    parts = []
    for message in messages:
        if message["role"] == "system":
            parts.append(message["content"] + "\n\n")
        elif message["role"] == "user":
            parts.append(f"User: {message['content']}\nAssistant:")
        else:
            parts.append(message["content"] + "\n\n")
    return "".join(parts)


def request(api: str, model_name: str, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    """The path and body of one turn's request (greedy): completions, else chat (auto not yet
    resolved against a tokenizer included)."""
    body = dict(model=model_name, max_tokens=max_tokens, temperature=0)
    if api == "completions":
        return "/v1/completions", dict(body, prompt=render_plain(messages))
    return "/v1/chat/completions", dict(body, messages=messages)


# -- one server ------------------------------------------------------------------------------


async def run_sessions(
    server, systems: list[str], args: argparse.Namespace, model_name: str, deadline_s: float | None = None
) -> tuple[list[Turn], float]:
    """Every session's turns; with deadline_s (from the start), no turn starts after it and the
    ones streaming then are cut off (finished=False), and the wall is the deadline."""
    import httpx

    from radixkv.scenarios.serve_http import Reply, stream

    limits = httpx.Limits(max_connections=args.sessions + 4, max_keepalive_connections=args.sessions + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s), limits=limits) as client:
        # Off the clock: one short request, so first-call costs are not the first turn's.
        await stream(client, server, *request(args.api, model_name, [{"role": "user", "content": "hi"}], 2))
        start = time.perf_counter()

        async def session(s: int) -> list[Turn]:
            messages = [{"role": "system", "content": systems[s % len(systems)]}]
            turns = []
            for t in range(args.turns):
                messages.append({"role": "user", "content": user_message(s, t)})
                sent = time.perf_counter() - start
                if deadline_s is not None and sent >= deadline_s:
                    break
                path, body = request(args.api, model_name, messages, args.reply_tokens)
                reply = Reply()
                try:
                    read = stream(client, server, path, dict(body, ignore_eos=True), reply)
                    await (read if deadline_s is None else asyncio.wait_for(read, deadline_s - sent))
                except asyncio.TimeoutError:
                    turns.append(Turn(s, t, sent, reply.ttft_s, deadline_s - sent, 0, None, len(reply.token_times_s), None, finished=False))
                    break
                turns.append(Turn(s, t, sent, reply.ttft_s, reply.wall_s, reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens, reply.error))
                if reply.error:
                    break
                messages.append({"role": "assistant", "content": reply.text})
            return turns

        done = await asyncio.gather(*(session(s) for s in range(args.sessions)))
        wall = time.perf_counter() - start
        finished = sum(turn.finished and not turn.error for turns in done for turn in turns)
        if deadline_s is not None and finished < args.sessions * args.turns:
            wall = deadline_s
    return [turn for turns in done for turn in turns], wall


def run_server(name: str, args: argparse.Namespace, systems: list[str], out: Path, deadline_s: float | None = None) -> dict:
    from radixkv.scenarios.llama_server import LlamaServerOptions, start_llama_server
    from radixkv.scenarios.serve_http import engine_knobs, metric_total, served_model, start_radixkv_serve

    model = model_path(args)
    slots = None if name == "radixkv" else args.llama_slots or args.sessions
    started = time.perf_counter()
    try:
        if name == "radixkv":
            knobs = engine_knobs(dict(weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, quant_kernel=args.quant_kernel, moe_kernel=args.moe_kernel))
            server = start_radixkv_serve(model, out / "radixkv-serve.log", dtype=args.dtype, num_pages=args.num_pages, threads=args.threads, knobs=knobs)
        else:
            ctx = args.prompt_tokens + args.turns * (args.reply_tokens + 64) + 512  # a session's whole history, and room
            options = LlamaServerOptions(slots=slots, ctx_per_slot=ctx, threads=args.threads, cache_ram_mib=args.cache_ram_mib, unified_kv=name.endswith("kvu"))
            server = start_llama_server(Path(model), out / f"{name}.log", options)
    except Exception as error:  # reported; the other servers still run
        return dict(server=name, error=f"{type(error).__name__}: {error}")
    load_s = time.perf_counter() - started
    with server:
        hits_before = metric_total(server, "radixkv_cached_prompt_tokens_total") if name == "radixkv" else None
        turns, wall = asyncio.run(run_sessions(server, systems, args, served_model(server), deadline_s))
        memory = server.memory()
        hits_after = metric_total(server, "radixkv_cached_prompt_tokens_total") if name == "radixkv" else None
        kv_pages = metric_total(server, "radixkv_kv_pages_total") if name == "radixkv" else None
    row = summarize(name, turns, wall, memory, load_s, args, None if hits_after is None else hits_after - (hits_before or 0))
    return dict(row, deadline_s=deadline_s, api=args.api, kv_pages=kv_pages, slots=slots)


def peer_deadline(args: argparse.Namespace, rows: list[dict]) -> float | None:
    """--peer-time-factor times radixkv's wall, once radixkv has run to the end; else None."""
    base = next((r for r in rows if r["server"] == "radixkv" and r.get("complete")), None)
    return args.peer_time_factor * base["wall_s"] if args.peer_time_factor > 0 and base else None


def model_path(args: argparse.Namespace) -> str:
    from radixkv.model.loader import default_model_gguf

    return args.model or str(default_model_gguf())


# -- report ----------------------------------------------------------------------------------


def busy_share(turns: list[Turn], wall: float) -> float:
    """Share of the wall time with some request before its first token (prefill or queued for it)."""
    spans = sorted((t.start_s, t.start_s + (t.ttft_s if t.ttft_s is not None else t.wall_s)) for t in turns)
    covered, end = 0.0, 0.0
    for a, b in spans:
        if b > end:
            covered += b - max(a, end)
            end = b
    return min(1.0, covered / wall) if wall else 0.0


def ttft_p90_lower_bound(turns: list[Turn], args) -> float:
    """p90 time to first token over the whole workload, each turn that had none by the deadline
    counted as waiting until then and each turn never sent as 0 s: below the true p90."""
    values = [t.ttft_s if t.ttft_s is not None else t.wall_s for t in turns if not t.error]
    values += [0.0] * (args.sessions * args.turns - len(values))
    return percentile(values, 0.9)


def summarize(name: str, turns: list[Turn], wall: float, memory: dict, load_s: float, args, metric_hits: float | None) -> dict:
    cut = [t for t in turns if not t.finished]
    ok = [t for t in turns if not t.error and t.finished]
    complete = len(ok) == args.sessions * args.turns
    prompt = sum(t.prompt_tokens for t in ok)
    reported = [t.cached_tokens for t in ok if t.cached_tokens is not None]
    cached = sum(reported) if len(reported) == len(ok) and ok else metric_hits
    output = sum(t.completion_tokens for t in ok) + sum(t.completion_tokens for t in cut)
    per_turn = []
    for index in range(args.turns):
        ttfts = [t.ttft_s for t in ok if t.turn == index and t.ttft_s is not None]
        per_turn.append(dict(turn=index, ttft_p50_s=percentile(ttfts, 0.5) if ttfts else None, ttft_p90_s=percentile(ttfts, 0.9) if ttfts else None))
    all_ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    prefill_share = busy_share(ok, wall)
    full = estimate_full(args, wall, prompt, cached or 0, output, prefill_share)
    return dict(
        server=name, error=next((t.error for t in turns if t.error), None), load_s=load_s, wall_s=wall,
        requests=len(turns), failed=len(turns) - len(ok) - len(cut), complete=complete, cut_off=len(cut),
        ttft_p90_lower_bound_s=None if complete else ttft_p90_lower_bound(turns, args), output_tokens=output, output_tokens_per_s=output / wall if wall else 0.0,
        prompt_tokens=prompt, cached_tokens=cached, cached_share=(cached / prompt) if cached is not None and prompt else None,
        ttft_p50_s=percentile(all_ttft, 0.5) if all_ttft else None, ttft_p90_s=percentile(all_ttft, 0.9) if all_ttft else None,
        per_turn=per_turn, rss_bytes=memory["rss_bytes"], peak_rss_bytes=memory["peak_rss_bytes"],
        prefill_share=prefill_share, full_size_estimate_s=full, turns=[asdict(t) for t in turns],
    )  # fmt: skip


def estimate_full(args, wall: float, prompt: int, cached: int, output: int, prefill_share: float) -> float | None:
    """The full size's (FULL) wall time, scaling this run's prefill share by the prompt tokens
    computed (this run's cached share applied to the full size's prompt tokens) and the rest by
    the output tokens. Rough: prefill grows faster than linearly with length, decode batches."""
    if not prompt or not output or not wall:
        return None
    history = lambda a: a["sessions"] * sum(a["prompt_tokens"] + t * (a["reply_tokens"] + 24) + 24 for t in range(a["turns"]))  # noqa: E731
    computed_share = 1 - cached / prompt
    full_computed = history(FULL) * computed_share
    run_computed = max(1.0, prompt * computed_share)
    full_output = FULL["sessions"] * FULL["turns"] * FULL["reply_tokens"]
    return wall * prefill_share * full_computed / run_computed + wall * (1 - prefill_share) * full_output / output


def print_table(rows: list[dict], args, limits: dict | None) -> dict:
    print(
        f"\nagent_sessions: {model_path(args)}; {args.sessions} sessions over {args.prompts} prompts of {args.prompt_tokens} tokens, "
        f"{args.turns} turns of {args.reply_tokens}-token replies, greedy, {args.threads} threads, {args.api} requests"
    )
    if limits:
        print(f"{limits['cpu']}: read {limits['read_bandwidth_gb_s']:.1f} GB/s, {limits['matmul_dtype']} matmul {limits['matmul_gflops']:.0f} GFLOP/s (this run)")
    header = f"{'server':<18}{'wall s':>8}{'out tok':>8}{'out tok/s':>10}{'ttft p50':>9}{'ttft p90':>9}{'cached':>8}{'RSS GB':>8}{'peak GB':>8}{'failed':>7}{'full est s':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if row.get("error") and not row.get("requests"):
            print(f"{row['server']:<18} failed: {row['error'].splitlines()[-1][:100]}")
            continue
        share = "-" if row["cached_share"] is None else f"{row['cached_share']:.0%}"
        est = "-" if row["full_size_estimate_s"] is None else f"{row['full_size_estimate_s']:.0f}"
        print(
            f"{row['server']:<18}{row['wall_s']:>8.1f}{row['output_tokens']:>8}{row['output_tokens_per_s']:>10.2f}{_s(row['ttft_p50_s'])}{_s(row['ttft_p90_s'])}"
            f"{share:>8}{row['rss_bytes'] / 1e9:>8.2f}{row['peak_rss_bytes'] / 1e9:>8.2f}{row['failed']:>7}{est:>11}"
        )
    for row in rows:
        if row.get("kv_pages") or row.get("slots"):
            print(f"  {row['server']}: " + (f"{row['kv_pages']:.0f} KV pages" if row.get("kv_pages") else f"{row['slots']} slots"))
    print("\nper turn, ttft p50 / p90 (s):")
    for row in rows:
        if row.get("per_turn"):
            print(f"  {row['server']:<18}" + "  ".join(f"t{p['turn']}: {_s(p['ttft_p50_s'], 0)} / {_s(p['ttft_p90_s'], 0)}" for p in row["per_turn"]))
    return ratios(rows)


def ratios(rows: list[dict]) -> dict:
    """radixkv over the better llama-server (higher output tokens/s): throughput and p90 TTFT."""
    base = next((r for r in rows if r["server"] == "radixkv" and r.get("requests") and not r["failed"]), None)
    llamas = [r for r in rows if r["server"].startswith("llama-server") and r.get("requests") and not r["failed"]]
    if not base or not llamas:
        return {}
    best = max(llamas, key=lambda r: r["output_tokens_per_s"])
    if not best.get("complete", True):
        return _bounded_ratios(base, best)
    result = dict(
        llama_server=best["server"],
        throughput_ratio=base["output_tokens_per_s"] / best["output_tokens_per_s"] if best["output_tokens_per_s"] else None,
        ttft_p90_ratio=base["ttft_p90_s"] / best["ttft_p90_s"] if base["ttft_p90_s"] and best["ttft_p90_s"] else None,
        wall_ratio=base["wall_s"] / best["wall_s"] if best["wall_s"] else None,
    )
    print(
        f"\nradixkv / {best['server']} (the better llama-server): throughput x{_f(result['throughput_ratio'])}, "
        f"p90 ttft x{_f(result['ttft_p90_ratio'])}, wall x{_f(result['wall_ratio'])}"
    )
    return result


def _bounded_ratios(base: dict, best: dict) -> dict:
    """The better llama-server was stopped at its deadline before the end: on the same work its
    wall is past the deadline, so radixkv's throughput is more than deadline / radixkv's wall
    times its, and the p90 ratio is at most radixkv's p90 over the peer's lower bound."""
    bound = best["ttft_p90_lower_bound_s"]
    result = dict(
        llama_server=best["server"], bounded=True,
        throughput_ratio_above=best["deadline_s"] / base["wall_s"] if base["wall_s"] else None,
        ttft_p90_ratio_below=base["ttft_p90_s"] / bound if base["ttft_p90_s"] and bound else None,
        wall_ratio_below=base["wall_s"] / best["deadline_s"] if best["deadline_s"] else None,
    )
    print(
        f"\nradixkv / {best['server']} (the better llama-server, stopped at {best['deadline_s']:.0f} s before the end): "
        f"throughput > x{_f(result['throughput_ratio_above'])}, p90 ttft < x{_f(result['ttft_p90_ratio_below'])}, "
        f"wall < x{_f(result['wall_ratio_below'])}"
    )
    return result


def _s(value: float | None, width: int = 9) -> str:
    text = "-" if value is None else f"{value:.2f}"
    return f"{text:>{width}}" if width else text


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(rows: list[dict], path: Path) -> None:
    from radixkv.scenarios.plots import pyplot, save

    plt = pyplot()
    ok = [r for r in rows if r.get("per_turn")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for row in ok:
        turns = [p["turn"] for p in row["per_turn"]]
        axes[0].plot(turns, [p["ttft_p90_s"] or 0 for p in row["per_turn"]], marker="o", label=f"{row['server']} p90")
        axes[0].plot(turns, [p["ttft_p50_s"] or 0 for p in row["per_turn"]], marker=".", linestyle="--", label=f"{row['server']} p50")
    axes[0].set_title("time to first token by turn (s)")
    axes[0].set_xlabel("turn")
    axes[0].legend(fontsize=7)
    axes[1].bar([r["server"] for r in ok], [r["output_tokens_per_s"] for r in ok])
    axes[1].set_title("output tokens / s over the run")
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from radixkv.scenarios.harness import load_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_path(args)
    servers = args.servers.split(",")
    if not model.endswith(".gguf"):
        print("note: llama-server needs a .gguf; left out", flush=True)
        servers = [s for s in servers if not s.startswith("llama-server")]
    tokenizer = load_tokenizer(model)  # the model's own tokens: --prompt-tokens counts them
    args.api = api_mode(args.api, tokenizer)
    print(f"api: {args.api}", flush=True)
    systems = system_prompts(tokenizer, args.prompts, args.prompt_tokens)
    rows = []
    for name in servers:
        print(f"running {name} ...", flush=True)
        rows.append(run_server(name, args, systems, out, peer_deadline(args, rows) if name.startswith("llama-server") else None))
    limits = None
    if args.limits:
        import torch

        from radixkv.scenarios.machine import machine_limits

        torch.set_num_threads(args.threads)  # the limits at the threads the peers ran with
        limits = machine_limits(torch.float32)
    compared = print_table(rows, args, limits)
    results = dict(
        scenario="agent_sessions", model=model, args=vars(args), full_size=FULL, machine_limits=limits, ratios=compared,
        command=" ".join(["python -m radixkv.scenarios.agent_sessions", *(argv if argv is not None else sys.argv[1:])]), rows=rows,
    )  # fmt: skip
    from radixkv.scenarios.plots import save_results

    save_results(out, "agent_sessions", results, lambda path: plot(rows, path))
    return 0 if all(r.get("requests") and not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
