"""Helpers for engine tests: transformers' greedy reference and the end-of-run page check."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def assert_all_pages_returned(llm) -> None:
    """Once every request has ended, each page is free or cached in the tree, unlocked."""
    engine = llm.engine
    engine.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.tree.locked_pages == 0
    assert engine.pool.num_free + engine.tree.cached_pages == engine.pool.num_pages
