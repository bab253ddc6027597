"""A 5-shot sentiment template and rows shared by the SDK tests."""

from __future__ import annotations

from radixkv.sdk import PromptTemplate

SYSTEM = "Classify the sentiment of each review as positive, negative or neutral."
EXAMPLES = [
    ("The battery died after two days.", "negative"),
    ("Fast delivery and a great bike.", "positive"),
    ("It works, nothing special.", "neutral"),
    ("Best purchase this year!", "positive"),
    ("The frame arrived scratched.", "negative"),
]
WORDS = "quick brown fox lazy dog capital France Paris cache prefix shares helpful assistant answer".split()


def five_shot() -> PromptTemplate:
    return PromptTemplate(system=SYSTEM, examples=EXAMPLES, user="Review: {review}")


def rows(count: int, seed: int = 0) -> list[str]:
    """Distinct reviews of varied length, so rows differ in more than a number."""
    out = []
    for i in range(count):
        k = 2 + (i * 7 + seed) % 5
        words = [WORDS[(i * 3 + j * (seed + 5)) % len(WORDS)] for j in range(k)]
        out.append(f"{' '.join(words)} {i}.")
    return out
