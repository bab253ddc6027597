"""The SDK tests' LLM (chat template on, a pool of 512 pages of PAGE_SIZE tokens) and the 5-shot
sentiment template with rows they share."""

from __future__ import annotations

from pathlib import Path

from radixkv import LLM
from radixkv.sdk import PromptTemplate
from tests.helpers.engine import make_llm

PAGE_SIZE = 4
NUM_PAGES = 512

SYSTEM = "Classify the sentiment of each review as positive, negative or neutral."
EXAMPLES = [
    ("The battery died after two days.", "negative"),
    ("Fast delivery and a great bike.", "positive"),
    ("It works, nothing special.", "neutral"),
    ("Best purchase this year!", "positive"),
    ("The frame arrived scratched.", "negative"),
]
WORDS = "quick brown fox lazy dog capital France Paris cache prefix shares helpful assistant answer".split()


def make_sdk_llm(model_dir: Path | str, *, chat: bool = True, **overrides) -> LLM:
    """The in-process LLM the SDK tests compare against the live server's engine."""
    return make_llm(model_dir, chat=chat, **{"page_size": PAGE_SIZE, "num_pages": NUM_PAGES, **overrides})


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
