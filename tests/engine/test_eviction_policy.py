"""The eviction policy in the engine: under the default slru a burst of one-off prompts leaves
a hot system prompt cached (under lru it flushes it), and the outputs stay exact either way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixkv import SamplingParams
from radixkv.cache.eviction import EVICTION_POLICIES
from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_llm

PARAMS = SamplingParams(max_tokens=4)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_burst_of_one_off_prompts_does_not_flush_the_system_prompt(tiny_llama: Path, policy: str) -> None:
    rng = random.Random(3)
    system = [rng.randrange(1, VOCAB) for _ in range(32)]  # 8 pages of 4 tokens
    chats = [system + [rng.randrange(1, VOCAB) for _ in range(5)] for _ in range(3)]
    burst = [[rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(6)]  # 11-12 pages each
    llm = make_llm(tiny_llama, num_pages=28, eviction_policy=policy)
    outputs = [llm.generate([prompt], PARAMS)[0] for prompt in (chats[0], chats[1], *burst, chats[2])]
    assert outputs[1].num_cached_tokens == len(system)  # the system prompt served a hit
    last = outputs[-1]
    assert last.num_cached_tokens == (len(system) if policy == "slru" else 0)
    assert last.token_ids == hf_greedy(tiny_llama, [chats[2]], 4)[0]
    assert_pages_returned(llm.engine)
