"""Few-shot template: one k-shot classification template (instruction plus worked examples)
run over many rows, each row a distinct input.

    python -m radixkv.scenarios.few_shot_template [--shots 5 --num-requests 32 ...]
"""

from __future__ import annotations

import sys

from radixkv.scenarios.harness import load_tokenizer, scenario_main
from radixkv.scenarios.peers import Workload

DEFAULTS = dict(name="few_shot_template", num_requests=32, output_len=4, extra={"shots": (int, 5, "worked examples")})

EXAMPLES = [
    ("The battery died after two days and support never answered.", "negative"),
    ("Delivery was fast and the bike rides beautifully.", "positive"),
    ("It works, nothing special, the manual is confusing.", "neutral"),
    ("Best purchase this year, my commute is half as long.", "positive"),
    ("The frame arrived scratched and the return took a month.", "negative"),
    ("Assembly took an hour; the brakes needed adjusting.", "neutral"),
    ("Great value, the shop even called to check on me.", "positive"),
    ("The saddle is hard but everything else is fine.", "neutral"),
]
REVIEWS = [
    "The chain snapped on the first ride.",
    "Lovely colour and very light.",
    "Arrived on time, does what it says.",
    "Customer service was rude and slow.",
    "I ride every day now, thank you!",
    "The lights are dim but usable.",
    "The motor is loud on hills.",
    "Perfect for my kids, easy to adjust.",
]


def template_text(shots: int) -> str:
    lines = ["Classify the sentiment of each customer review as positive, negative or neutral.", ""]
    for review, label in EXAMPLES[:shots]:
        lines += [f"Review: {review}", f"Sentiment: {label}", ""]
    return "\n".join(lines)


def build(args) -> Workload:
    tokenizer = load_tokenizer(args.model)
    shared = template_text(args.shots)
    prompts = []
    for i in range(args.num_requests):
        review = f"{REVIEWS[i % len(REVIEWS)]} (order {1000 + i})"
        prompts.append(tokenizer(f"{shared}Review: {review}\nSentiment:", add_special_tokens=False).input_ids)
    return Workload(DEFAULTS["name"], prompts, args.output_len, model=args.model, dtype=args.dtype, device=args.device)


def main(argv: list[str] | None = None) -> int:
    return scenario_main(argv, __doc__, DEFAULTS, build)


if __name__ == "__main__":
    sys.exit(main())
