"""Exact continuation in multi-turn chat with sampled replies: of the tokens the previous turn
computed (its prompt and its reply), the share the next turn finds in the cache, per turn, with
continuation on and off, for the default model's template and for one that drops earlier turns'
reasoning (scenarios/data/reasoning_chatml.jinja), over chat completions (the client sends the
history back) and the Responses API (previous_response_id).

    python -m radixkv.scenarios.chat_continuation [--model M] [--conversations 4 --turns 4
        --reply-tokens 64] [--templates default,reasoning] [--apis chat,responses]

Replies are sampled at temperature 1 with a fixed seed per conversation and turn, through the
real app on loopback (two apps over one engine: continuation on and off, each arm in its own
cache partition). Under the reasoning template every reply is held by a regex to
`<think>` one sentence `</think>` then an answer, as a reasoning model writes. A turn's reusable tokens are
the previous turn's prompt plus its reply; its hit share is cached_tokens / reusable (at most
the full pages of reusable - 1: the last sampled token is never fed back, and only full pages
are cached: the `ceiling` column).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TEMPLATES = ("default", "reasoning")
APIS = ("chat", "responses")
REASONING_TEMPLATE = Path(__file__).parent / "data" / "reasoning_chatml.jinja"
REASONING_REGEX = r"<think>[A-Za-z ,']+\.</think>[^<>]+"  # no newlines: guided replies take no control characters
SYSTEM = (
    "You are a friendly assistant for a bicycle shop. You answer questions about bikes, repairs, "
    "opening hours and prices. Keep answers short, concrete and polite."
)
QUESTIONS = (
    "Which bike suits a daily ten kilometre commute?",
    "How often should I oil the chain?",
    "What does a tune-up include?",
    "Can you fit a child seat to a road bike?",
    "Why does my rear brake squeal?",
    "Is an electric bike worth it for hills?",
    "How do I choose the right frame size?",
    "What tyre pressure should I ride at?",
)
MODEL = "continuation-model"


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    reply_tokens: int
    reusable_tokens: int  # the previous turn's prompt + reply (0 on a conversation's first turn)
    reply_retokenizes_otherwise: bool | None  # its generated ids are not what its text encodes to (None: unknown)


@dataclass(slots=True)
class Arm:
    template: str
    api: str
    continuation: bool
    turns: list[Turn] = field(default_factory=list)

    def share(self, turn: int) -> float:
        rows = [t for t in self.turns if t.turn == turn and t.reusable_tokens]
        reusable = sum(t.reusable_tokens for t in rows)
        return sum(min(t.cached_tokens, t.reusable_tokens) for t in rows) / reusable if reusable else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2's GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--templates", default=",".join(TEMPLATES))
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--out", default="out/chat_continuation")
    args = parser.parse_args(argv)
    for name, known in (("templates", TEMPLATES), ("apis", APIS)):
        unknown = [v for v in getattr(args, name).split(",") if v not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; known: {', '.join(known)}")
    if min(args.conversations, args.turns, args.reply_tokens) < 1 or args.turns < 2:
        parser.error("--conversations and --reply-tokens must be at least 1, --turns at least 2")
    return args


def run_conversation(
    client: Any, tokenizer: Any, generated: Callable[[str], list[int] | None], arm: Arm, index: int, args: argparse.Namespace, salt: str
) -> None:
    """One conversation's turns in order, sampled, appended to arm.turns."""
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    previous_id: str | None = None
    reusable = 0
    extra: dict[str, Any] = {"cache_salt": salt}
    if arm.template == "reasoning":
        extra["guided_regex"] = REASONING_REGEX
    for turn in range(args.turns):
        question = QUESTIONS[(index + turn) % len(QUESTIONS)]
        seed = 1000 * index + turn
        if arm.api == "chat":
            history.append({"role": "user", "content": question})
            reply = client.chat.completions.create(
                model=MODEL, messages=history, temperature=1.0, seed=seed, max_tokens=args.reply_tokens, extra_body=extra
            )
            text = reply.choices[0].message.content or ""
            usage = reply.usage
            prompt, cached, out = usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0, usage.completion_tokens
            history.append({"role": "assistant", "content": text})
        else:
            reply = client.responses.create(
                model=MODEL, input=question, instructions=SYSTEM, previous_response_id=previous_id,
                temperature=1.0, max_output_tokens=args.reply_tokens, extra_body={**extra, "seed": seed},
            )  # fmt: skip
            previous_id, text = reply.id, reply.output_text
            usage = reply.usage
            prompt, cached, out = usage.input_tokens, usage.input_tokens_details.cached_tokens or 0, usage.output_tokens
        ids = generated(text)
        differs = None if ids is None else ids != tokenizer(text, add_special_tokens=False).input_ids
        arm.turns.append(Turn(index, turn, prompt, cached, out, reusable, differs))
        reusable = prompt + out


def run_arm(server: Any, state: Any, arm: Arm, args: argparse.Namespace) -> None:
    """An arm's conversations side by side (the engine batches them), each turn after the last."""
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=3600)
    salt = f"{arm.template}-{arm.api}-{'on' if arm.continuation else 'off'}"
    tokenizer, owner = state.engine.tokenizer, state.tenants.owner(None)
    partition = state.tenants.cache_salt(None, salt)  # where the server keeps the arm's replies

    def generated(text: str) -> list[int] | None:
        # The chat map knows the ids a reply was generated as (continuation on, chat only).
        return None if state.replies is None else state.replies.get(owner, text, salt=partition)

    threads = [
        threading.Thread(target=run_conversation, args=(client, tokenizer, generated, arm, c, args, salt)) for c in range(args.conversations)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(arm.turns) != args.conversations * args.turns:
        raise RuntimeError(f"{salt}: {args.conversations * args.turns - len(arm.turns)} turns failed (see above)")


def ceiling(arm: Arm, turn: int, page_size: int) -> float:
    rows = [t for t in arm.turns if t.turn == turn and t.reusable_tokens]
    reusable = sum(t.reusable_tokens for t in rows)
    return sum((t.reusable_tokens - 1) // page_size * page_size for t in rows) / reusable if reusable else 0.0


def table(arms: list[Arm], turns: int, page_size: int) -> str:
    # Turns are numbered from 1 here; turn 1 has nothing before it to reuse.
    head = f"{'template':<10}{'api':<11}{'continuation':<13}" + "".join(f"{f'turn {t + 1}':>8}" for t in range(1, turns)) + f"{'mean':>8}{'ceiling':>9}"
    lines = [head, "-" * len(head)]
    for arm in arms:
        shares = [arm.share(t) for t in range(1, turns)]
        ceil = sum(ceiling(arm, t, page_size) for t in range(1, turns)) / (turns - 1)
        lines.append(
            f"{arm.template:<10}{arm.api:<11}{'on' if arm.continuation else 'off':<13}"
            + "".join(f"{s:>8.3f}" for s in shares) + f"{sum(shares) / len(shares):>8.3f}{ceil:>9.3f}"
        )  # fmt: skip
    return "\n".join(lines)


def retokenized(arms: list[Arm]) -> str:
    """How many sampled replies' ids differ from what their text encodes to (known where the
    chat map holds them: chat with continuation on)."""
    lines = []
    for arm in arms:
        if arm.api != "chat":
            continue
        known = [t.reply_retokenizes_otherwise for t in arm.turns if t.reply_retokenizes_otherwise is not None]
        if known:
            lines.append(f"{arm.template} {arm.api}: {sum(known)} of {len(known)} replies were generated as ids their text does not encode to")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine
    from radixkv.scenarios.plots import save_results
    from radixkv.server.app import create_app
    from radixkv.server.limits import ServerLimits
    from radixkv.server.thread import ServerThread

    engine = AsyncEngine(Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_pages=args.num_pages)))
    tokenizer = engine.tokenizer
    default_template = tokenizer.chat_template
    page_size = engine.engine.config.page_size
    arms: list[Arm] = []
    try:
        apps = {on: create_app(engine, model_name=MODEL, limits=ServerLimits(exact_continuation=on)) for on in (True, False)}
        with ServerThread(apps[True]) as server_on, ServerThread(apps[False]) as server_off:
            for template in args.templates.split(","):
                # The template is the tokenizer's: every request of the last one has finished.
                tokenizer.chat_template = REASONING_TEMPLATE.read_text() if template == "reasoning" else default_template
                for api in args.apis.split(","):
                    for on, server in ((True, server_on), (False, server_off)):
                        arm = Arm(template, api, on)
                        run_arm(server, apps[on].state.radixkv, arm, args)
                        arms.append(arm)
                        print(f"{template} {api} continuation={'on' if on else 'off'}: mean share "
                              f"{sum(arm.share(t) for t in range(1, args.turns)) / (args.turns - 1):.3f}", flush=True)  # fmt: skip
    finally:
        tokenizer.chat_template = default_template
        engine.shutdown()
    text = table(arms, args.turns, page_size) + "\n" + retokenized(arms)
    print("\nshare of the previous turn's prompt + reply tokens found cached, per turn\n" + text)
    results = {
        "scenario": "chat_continuation",
        "args": vars(args),
        "page_size": page_size,
        "table": text,
        "arms": [
            {"template": a.template, "api": a.api, "continuation": a.continuation,
             "share_per_turn": [a.share(t) for t in range(1, args.turns)],
             "ceiling_per_turn": [ceiling(a, t, page_size) for t in range(1, args.turns)],
             "turns": [asdict(t) for t in a.turns]}
            for a in arms
        ],
    }  # fmt: skip
    save_results(args.out, "chat_continuation", results, lambda path: plot(arms, args.turns, path))
    return 0


def plot(arms: list[Arm], turns: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for arm in arms:
        style = "-" if arm.continuation else "--"
        ax.plot(range(1, turns), [arm.share(t) for t in range(1, turns)], style, marker="o",
                label=f"{arm.template} {arm.api} {'on' if arm.continuation else 'off'}")  # fmt: skip
    ax.set_xlabel("turn")
    ax.set_ylabel("share of previous turn's tokens cached")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
