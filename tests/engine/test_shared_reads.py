"""Shared decode reads through the engine (EngineConfig.share_decode_reads): requests decoding
over one cached system prompt give the very tokens they give without it, equal transformers'
greedy tokens in fp32, and the engine counts the KV reads the sharing saved."""

from __future__ import annotations

import random

import pytest

from radixkv import SamplingParams
from radixkv.cpu.native import load
from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_llm

pytestmark = pytest.mark.skipif(load() is None, reason="needs the native kernels (no C compiler here)")


def agent_prompts(seed: int, groups: int = 2, members: int = 4, system_len: int = 300) -> list[list[int]]:
    """Groups of requests over one long system prompt each (past a 256-key chunk of the
    kernel), each with a short question of its own."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(1, VOCAB) for _ in range(system_len)]
        prompts += [system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(members)]
    return prompts


def run(tiny_llama, prompts, share: bool, dtype: str = "float32"):
    llm = make_llm(tiny_llama, share_decode_reads=share, dtype=dtype, page_size=16, num_pages=256)
    llm.generate([prompts[0]], SamplingParams(max_tokens=1))  # the first system prompt cached
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10))
    assert_pages_returned(llm.engine)
    return [o.token_ids for o in outputs], llm.engine.counters


def test_greedy_tokens_are_the_same_with_and_without_shared_reads(tiny_llama):
    prompts = agent_prompts(1)
    shared, shared_counters = run(tiny_llama, prompts, share=True)
    plain, plain_counters = run(tiny_llama, prompts, share=False)
    assert shared == plain == hf_greedy(tiny_llama, prompts, 10)
    assert shared_counters.num_kv_tokens_read == plain_counters.num_kv_tokens_read > 0
    assert plain_counters.num_kv_tokens_read_shared == 0
    # Each decode step, three of a group's four members read its first 256 keys from cache.
    assert shared_counters.num_kv_tokens_read_shared >= 2 * 3 * 256 * 8


def test_bf16_outputs_are_bit_identical_with_and_without_shared_reads(tiny_llama):
    prompts = agent_prompts(2)
    assert run(tiny_llama, prompts, share=True, dtype="bfloat16")[0] == run(tiny_llama, prompts, share=False, dtype="bfloat16")[0]
