"""An agent pauses for a tool call while other tenants' traffic fills a small cache: its next
turn's cached share and time to first token, with and without a session (engine/sessions.py,
OpenAI's prompt_cache_key). The agent's turns (a long system prompt with tools, then each turn's
question, reply and tool result) run on one engine with a pool a few contexts large; between
turns, other tenants' one-off prompts turn the pool over several times.

Retention never locks: it makes a turn go last, so the pool must hold the in-flight traffic
beside it (--concurrency requests of --other-len at once); past that the turn is evicted too.

    radixkv bench tool_pause [--system-len 1024] [--turns 3] [--others 6] [--other-len 512] [--model PATH] [--out out/tool_pause]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.scenarios.harness import text_tokens
from radixkv.scenarios.machine import cpu_model

AGENT = SessionRef("agent-tenant", "agent-session-1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--system-len", type=int, default=1024, help="tokens of the system prompt and tools")
    parser.add_argument("--turns", type=int, default=3, help="the agent's turns (a tool pause before each but the first)")
    parser.add_argument("--turn-len", type=int, default=48, help="tokens of each turn's question or tool result")
    parser.add_argument("--reply-len", type=int, default=32, help="tokens of each reply (generated, end of sequence ignored)")
    parser.add_argument("--others", type=int, default=6, help="other tenants' requests during each pause")
    parser.add_argument("--other-len", type=int, default=512, help="tokens of each of those")
    parser.add_argument("--concurrency", type=int, default=2, help="of those, how many run at once")
    parser.add_argument("--pool-contexts", type=float, default=2.0, help="the page pool, in the agent's final contexts")
    parser.add_argument("--out", default="out/tool_pause")
    args = parser.parse_args(argv)

    from radixkv.engine.build import load_engine_model
    from radixkv.model.device import resolve_device

    context = args.system_len + args.turns * (args.turn_len + args.reply_len) + 8
    base = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=max(context, args.other_len) + 8)
    num_pages = max(8, int(args.pool_contexts * context / base.page_size))
    base = replace(base, num_pages=num_pages)
    loaded = load_engine_model(base, resolve_device(base.device))
    tokenizer = loaded.tokenizer

    runs = {}
    for name, session in (("without a session", None), ("with a session", AGENT)):
        engine = Engine(base, loaded=loaded)
        runs[name] = _agent(engine, tokenizer, args, session)
        del engine

    print(f"{cpu_model()}; model {loaded.path} {loaded.dtype}; pool {num_pages} pages of {base.page_size} tokens "
          f"({num_pages * base.page_size:,} tokens); each pause: {args.others} other prompts of {args.other_len} tokens, "
          f"{args.concurrency} at a time\n")
    print(f"{'turn':>4} {'prompt':>7} | {'cached share':>12} {'TTFT s':>8} (no session) | {'cached share':>12} {'TTFT s':>8} (session)")
    without, with_session = runs["without a session"], runs["with a session"]
    for a, b in zip(without, with_session):
        print(f"{a['turn']:>4} {a['prompt_tokens']:>7,} | {a['cached_share']:>12.2f} {a['ttft_s']:>8.3f}              | "
              f"{b['cached_share']:>12.2f} {b['ttft_s']:>8.3f}")
    resumed = [(a, b) for a, b in zip(without, with_session) if a["turn"] > 0]
    if resumed:
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        a_rows, b_rows = [a for a, _ in resumed], [b for _, b in resumed]
        print(f"\nafter a pause, mean: cached share {mean(a_rows, 'cached_share'):.2f} -> {mean(b_rows, 'cached_share'):.2f}, "
              f"TTFT {mean(a_rows, 'ttft_s'):.3f} s -> {mean(b_rows, 'ttft_s'):.3f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": loaded.path,
        "dtype": str(loaded.dtype),
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "page_size": base.page_size,
        "num_pages": num_pages,
        "args": vars(args),
        "runs": runs,
    }
    (out / "tool_pause.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'tool_pause.json'}")
    return 0


def _agent(engine: Engine, tokenizer, args: argparse.Namespace, session: SessionRef | None) -> list[dict]:
    """The agent's turns, each after a pause filled with other tenants' traffic; a row per turn."""
    conversation = text_tokens(tokenizer, args.system_len)
    rows = []
    for turn in range(args.turns):
        if turn:
            _other_traffic(engine, tokenizer, args, turn)
        conversation = conversation + text_tokens(tokenizer, args.turn_len, offset=7919 * (turn + 1))
        output = _run(engine, conversation, SamplingParams(max_tokens=args.reply_len, ignore_eos=True), session=session)
        rows.append({
            "turn": turn,
            "prompt_tokens": len(conversation),
            "cached_tokens": output.num_cached_tokens,
            "cached_share": output.num_cached_tokens / len(conversation),
            "ttft_s": output.time_to_first_token_s,
        })  # fmt: skip
        conversation = conversation + output.outputs[0].token_ids  # the reply's own ids: an exact continuation
    return rows


def _other_traffic(engine: Engine, tokenizer, args: argparse.Namespace, pause: int) -> None:
    """Other tenants' one-off prompts, --concurrency at a time, each in its own partition."""
    pending = list(range(args.others))
    while pending or engine.has_unfinished():
        while pending and engine.num_unfinished < args.concurrency:
            i = pending.pop(0)
            prompt = text_tokens(tokenizer, args.other_len, offset=104729 * pause + 613 * i)
            engine.add_request(prompt, SamplingParams(max_tokens=1), salt=f"tenant-{i}", owner=f"tenant-{i}")
        engine.step()


def _run(engine: Engine, prompt: list[int], params: SamplingParams, session: SessionRef | None) -> RequestOutput:
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params, session=session)
    while True:
        for delta in engine.step():
            if delta.request_id == request_id and delta.finished:
                assert delta.output is not None
                output = delta.output
                if output.time_to_first_token_s is None:  # never sampled: count the whole request
                    output.time_to_first_token_s = time.perf_counter() - start
                return output


if __name__ == "__main__":
    sys.exit(main())
