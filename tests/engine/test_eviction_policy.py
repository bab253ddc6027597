"""The eviction policy in the engine: under the default slru a burst of one-off prompts leaves
a hot system prompt cached (under lru it flushes it), and the outputs stay exact either way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixkv import SamplingParams
from radixkv.cache.eviction import EVICTION_POLICIES, Liveness
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


@pytest.mark.parametrize("policy", ["session", "lru"])
def test_a_prefix_marked_dead_goes_first_under_session(tiny_llama: Path, policy: str) -> None:
    """What a session book does through KVManager: under `session` a released conversation's
    prefix, though newer, is evicted before an older unmarked one (under lru the older goes);
    outputs stay exact."""
    rng = random.Random(5)
    older, newer = ([rng.randrange(1, VOCAB) for _ in range(33)] for _ in range(2))  # 8 full pages each
    burst = [rng.randrange(1, VOCAB) for _ in range(56)]  # 15 pages with its reply: 5 more than are free
    llm = make_llm(tiny_llama, num_pages=28, eviction_policy=policy)
    llm.generate([older], PARAMS)
    llm.generate([newer], PARAMS)
    kv = llm.engine.kv
    assert kv.mark(newer, Liveness.DEAD) >= 1
    llm.generate([burst], PARAMS)  # needs pages only an eviction frees
    kept = {name: kv.peek_prefix(tokens, None).num_cached_tokens for name, tokens in (("older", older), ("newer", newer))}
    if policy == "session":
        assert kept["older"] == 32 and kept["newer"] < 32
    else:
        assert kept["older"] < 32 and kept["newer"] == 32
    again = llm.generate([newer], PARAMS)[0]
    assert again.token_ids == hf_greedy(tiny_llama, [newer], 4)[0]
    assert_pages_returned(llm.engine)
