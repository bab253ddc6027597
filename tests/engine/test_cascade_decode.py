"""Cascade decode through the engine (EngineConfig.share_decode_reads): requests decoding over
one cached system prompt read it once per step as a group, give the tokens they give without
it (equal to transformers' greedy tokens in fp32), keep doing so when pages run out and
requests are preempted or their prefix evicted, and the engine counts the reads it saved."""

from __future__ import annotations

import random

import pytest

from radixkv import SamplingParams
from radixkv.cpu import decode
from radixkv.cpu.native import load
from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_llm

pytestmark = pytest.mark.skipif(load() is None, reason="needs the native kernels (no C compiler here)")


@pytest.fixture(autouse=True)
def groups_over_any_shared_page(monkeypatch):
    """The tiny model's KV is far smaller than any L2, so no prefix of it would reach the byte
    threshold (decode.cascade_thresholds): these tests are about groups, so they lift it."""
    monkeypatch.setattr(decode, "MIN_SAVED_L2_FRACTION", 0.0)
    monkeypatch.setattr(decode, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(decode, "MIN_GROUP_QUERY_HEADS", 8)


def agent_prompts(seed: int, groups: int = 2, members: int = 5, system_len: int = 300) -> list[list[int]]:
    """Groups of requests over one long system prompt each (past a 256-key chunk of the
    kernel, and off the page grid), each with a short question of its own. The tiny model's
    GQA 2 needs 4 members to a group (decode.min_members, at the 8
    query heads the fixture sets)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(1, VOCAB) for _ in range(system_len)]
        prompts += [system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(members)]
    return prompts


def run(tiny_llama, prompts, share: bool, num_pages: int = 256, max_tokens: int = 10, tiles: bool = True):
    llm = make_llm(tiny_llama, share_decode_reads=share, page_size=16, num_pages=num_pages, cascade_tiles=tiles)
    llm.generate([prompts[0]], SamplingParams(max_tokens=1))  # the first system prompt cached
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    assert_pages_returned(llm.engine)
    return [o.token_ids for o in outputs], llm


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "member_by_member"])
def test_greedy_tokens_are_the_same_with_and_without_cascade(tiny_llama, tiles):
    # EngineConfig.cascade_tiles=False runs the groups' shared keys member by member: any CPU
    # checks both shared paths.
    prompts = agent_prompts(1)
    try:
        cascade, cascade_llm = run(tiny_llama, prompts, share=True, tiles=tiles)
    finally:
        decode.use_cascade_tiles(True)  # a process-wide setting: back to its default
    plain, plain_llm = run(tiny_llama, prompts, share=False)
    assert cascade == plain == hf_greedy(tiny_llama, prompts, 10)
    on, off = cascade_llm.engine.counters, plain_llm.engine.counters
    assert on.num_kv_tokens_read == off.num_kv_tokens_read > 0
    assert off.num_kv_tokens_read_shared == 0
    # Each decode step, four of a group's five members skip reading its 288 shared tokens.
    assert on.num_kv_tokens_read_shared >= 2 * 4 * 288 * 8


def test_preemption_and_eviction_mid_run_keep_outputs_exact(tiny_llama):
    # 30 pages of 16 tokens for 10 requests of ~22 pages each, 2 x 18 of them shareable: groups
    # form, then requests are preempted and the prefix pages evicted and recomputed as the pool
    # runs out; every step's plan is rebuilt from its tables.
    prompts = agent_prompts(3)
    tokens, llm = run(tiny_llama, prompts, share=True, num_pages=30, max_tokens=40)
    assert tokens == hf_greedy(tiny_llama, prompts, 40)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.cache.evicted_pages > 0
    assert llm.engine.counters.num_kv_tokens_read_shared > 0


def test_batch_invariant_steps_form_groups_and_keep_every_bit(tiny_llama):
    # Batch-invariant engines (the default for quantized weights) group too: each group's shared
    # part on the 256-key chunk grid, each member computed as the plain kernel computes it alone,
    # so the tokens and the logits are those of cascade off, and the shared keys are read once.
    prompts = agent_prompts(5)
    outputs = {}
    for share in (True, False):
        llm = make_llm(tiny_llama, share_decode_reads=share, page_size=16, num_pages=256, batch_invariant=True)
        llm.generate([prompts[0]], SamplingParams(max_tokens=1))
        out = llm.generate(prompts, SamplingParams(max_tokens=8, logprobs=5))
        assert_pages_returned(llm.engine)
        outputs[share] = ([o.token_ids for o in out], [o.outputs[0].logprobs for o in out], llm.engine.counters)
    (on_tokens, on_logprobs, on), (off_tokens, off_logprobs, off) = outputs[True], outputs[False]
    assert on_tokens == off_tokens == hf_greedy(tiny_llama, prompts, 8)
    assert on_logprobs == off_logprobs
    assert off.num_kv_tokens_read_shared == 0
    # Four of a group's five members skip its 288 shared tokens cut to the chunk grid, 256.
    assert on.num_kv_tokens_read_shared >= 4 * 256 * 7 and on.num_kv_tokens_read_shared % 256 == 0
