"""Multi-turn chat: several conversations over several turns, each turn resending the whole
history (system prompt, earlier questions and replies), turns of all conversations interleaved.

    python -m radixkv.scenarios.multi_turn_chat [--conversations 8 --turns 4 --system-len 256 ...]
"""

from __future__ import annotations

import sys

from radixkv.scenarios.harness import load_tokenizer, scenario_main, text_tokens
from radixkv.scenarios.peers import Workload

DEFAULTS = dict(
    name="multi_turn_chat",
    num_requests=32,  # conversations x turns
    output_len=16,
    extra={
        "turns": (int, 4, "turns per conversation"),
        "system-len": (int, 256, "tokens of the shared system prompt"),
        "question-len": (int, 96, "tokens of each user message"),
        "reply-len": (int, 64, "tokens of each earlier assistant reply in the history"),
    },
)


def build(args) -> Workload:
    tokenizer = load_tokenizer(args.model)
    conversations = max(1, args.num_requests // args.turns)
    system = text_tokens(tokenizer, args.system_len)
    prompts, rounds = [], []
    histories = [list(system) for _ in range(conversations)]
    for turn in range(args.turns):
        for c in range(conversations):
            histories[c] += text_tokens(tokenizer, args.question_len, offset=500 + 53 * c + 211 * turn)
            prompts.append(list(histories[c]))
            rounds.append(turn)
            # The reply the history carries into the next turn (scripted, so every peer sees
            # the same prompts whatever it generates).
            histories[c] += text_tokens(tokenizer, args.reply_len, offset=900 + 29 * c + 101 * turn)
    return Workload(DEFAULTS["name"], prompts, args.output_len, model=args.model, dtype=args.dtype, device=args.device, rounds=rounds)


def main(argv: list[str] | None = None) -> int:
    return scenario_main(argv, __doc__, DEFAULTS, build)


if __name__ == "__main__":
    sys.exit(main())
