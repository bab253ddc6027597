"""Agent system prompt: groups of requests share a long system prompt, each with a short
distinct question (SGLang's generated-shared-prefix shape, scaled for a 2-core CPU).

    python -m radixkv.scenarios.agent_system_prompt [--groups 4 --system-len 1024 --question-len 64 ...]
"""

from __future__ import annotations

import sys

from radixkv.scenarios.harness import load_tokenizer, parse_args, peer_list, run, text_tokens
from radixkv.scenarios.peers import Workload

DEFAULTS = dict(
    name="agent_system_prompt",
    num_requests=64,
    output_len=32,
    extra={
        "groups": (int, 4, "distinct system prompts"),
        "system-len": (int, 1024, "tokens of each system prompt"),
        "question-len": (int, 64, "tokens of each question"),
        "decode-profile": (int, 1, "1: also time one decode step of 32 requests and say where the time goes"),
    },
)


def build(args) -> Workload:
    tokenizer = load_tokenizer(args.model)
    prompts = []
    for i in range(args.num_requests):
        group = i % args.groups
        system = text_tokens(tokenizer, args.system_len, offset=97 * group)
        question = text_tokens(tokenizer, args.question_len, offset=1000 + 37 * i)
        prompts.append(system + question)
    return Workload(DEFAULTS["name"], prompts, args.output_len, model=args.model, dtype=args.dtype)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__, DEFAULTS)
    workload = build(args)
    after = None
    if args.decode_profile:
        from radixkv.scenarios.decode_profile import profile_decode

        after = lambda: {"decode_profile": profile_decode(args.model, args.dtype)}  # noqa: E731
    run(workload, peer_list(args.peers), args.out, after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
