"""Few-shot sentiment classification with the radixkv SDK: one 5-shot template run over a list
of reviews. The system prompt and the examples are computed once; every other row is served
them from the prefix cache and computes only its own review.

    python -m radixkv.scenarios.few_shot_classify

Copy it as a starting point: change the examples, the inputs, or pass a model to LLM(). For a
running `radixkv serve`, pass `openai.OpenAI(base_url=".../v1", api_key=...)` instead of `llm`.
"""

from __future__ import annotations

import argparse
import sys

from radixkv import LLM, SamplingParams
from radixkv.sdk import PromptTemplate, run_batch

LABELS = ("positive", "negative", "neutral")

# chat=False: a completion-style prompt ("Review: ...\nSentiment: label"), which a model this
# small follows far better than chat turns; leave it out to render through the chat template.
TEMPLATE = PromptTemplate(
    system="Classify the sentiment of each customer review as positive, negative or neutral.",
    examples=[
        ("The battery died after two days and support never answered.", "negative"),
        ("Delivery was fast and the bike rides beautifully.", "positive"),
        ("It works. Nothing special, nothing wrong.", "neutral"),
        ("Best purchase this year, my commute is half as long.", "positive"),
        ("The frame arrived scratched and the refund took a month.", "negative"),
    ],
    user="Review: {review}\nSentiment:",
    chat=False,
)

REVIEWS = [
    "The chain snapped on the first ride.",
    "Lovely colour and very light.",
    "Arrived on time, does what it says.",
    "Customer service was rude and slow.",
    "I ride to work every day now, thank you!",
    "The lights are dim but usable.",
    "The motor is loud on hills and the app keeps crashing.",
    "Perfect for my kids, easy to adjust.",
    "Average bike for an average price.",
    "Terrible brakes, I almost crashed.",
    "The staff helped me pick the right size. Great experience.",
    "The saddle is okay.",
]


def label_of(text: str) -> str:
    words = text.strip().lower().split()
    word = words[0].strip(".,!:;\"'") if words else ""
    return word if word in LABELS else f"? ({text.strip()!r})"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    results = run_batch(llm, TEMPLATE, REVIEWS, SamplingParams(max_tokens=2))
    width = max(map(len, REVIEWS)) + 2
    print(f"\n{'review':<{width}} {'label':<9} cached/prompt tokens")
    for review, result in zip(REVIEWS, results):
        if not result.ok:
            print(f"{review:<{width}} error: {result.error}")
            continue
        print(f"{review:<{width}} {label_of(result.text):<9} {result.num_cached_tokens}/{result.num_prompt_tokens}")
    num_prompt_tokens = sum(r.num_prompt_tokens for r in results)
    num_cached_tokens = sum(r.num_cached_tokens for r in results)
    print(f"\ncache hit rate: {num_cached_tokens}/{num_prompt_tokens} prompt tokens = {num_cached_tokens / num_prompt_tokens:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
