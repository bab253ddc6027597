"""Tree of thought: a problem prompt branches into several lines of thought, each branching
again; every node of the tree is a request that continues its whole path.

    python -m radixkv.scenarios.tree_of_thought [--branching 3 --depth 2 ...]
"""

from __future__ import annotations

import sys

from radixkv.scenarios.harness import load_tokenizer, scenario_main, text_tokens
from radixkv.scenarios.peers import Workload

DEFAULTS = dict(
    name="tree_of_thought",
    num_requests=0,  # derived: branching + branching^2 + ...
    output_len=16,
    extra={
        "branching": (int, 3, "children per node"),
        "depth": (int, 3, "levels below the root"),
        "root-len": (int, 384, "tokens of the problem statement"),
        "thought-len": (int, 48, "tokens each thought adds to its path"),
    },
)


def build(args) -> Workload:
    tokenizer = load_tokenizer(args.model)
    level = [text_tokens(tokenizer, args.root_len)]
    prompts, rounds = [], []
    for depth in range(args.depth):
        next_level = []
        for p, path in enumerate(level):
            for b in range(args.branching):
                offset = 300 + 71 * (p * args.branching + b) + 13 * depth
                next_level.append(path + text_tokens(tokenizer, args.thought_len, offset=offset))
        prompts += next_level
        rounds += [depth] * len(next_level)
        level = next_level
    return Workload(DEFAULTS["name"], prompts, args.output_len, model=args.model, dtype=args.dtype, device=args.device, rounds=rounds)


def main(argv: list[str] | None = None) -> int:
    return scenario_main(argv, __doc__, DEFAULTS, build)


if __name__ == "__main__":
    sys.exit(main())
