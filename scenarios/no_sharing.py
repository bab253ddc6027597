"""No sharing: distinct prompts that share nothing — the control that shows what prefix
caching costs when it cannot help.

    python -m radixkv.scenarios.no_sharing [--num-requests 16 --prompt-len 512 ...]
"""

from __future__ import annotations

import sys

from radixkv.scenarios.harness import load_tokenizer, scenario_main, text_tokens
from radixkv.scenarios.peers import Workload

DEFAULTS = dict(
    name="no_sharing", num_requests=16, output_len=32, extra={"prompt-len": (int, 512, "tokens of each prompt")}
)


def build(args) -> Workload:
    tokenizer = load_tokenizer(args.model)
    # Each prompt starts at its own offset of the text, so no two share even a first block.
    prompts = [text_tokens(tokenizer, args.prompt_len, offset=61 * i + 1) for i in range(args.num_requests)]
    return Workload(DEFAULTS["name"], prompts, args.output_len, model=args.model, dtype=args.dtype, device=args.device)


def main(argv: list[str] | None = None) -> int:
    return scenario_main(argv, __doc__, DEFAULTS, build)


if __name__ == "__main__":
    sys.exit(main())
