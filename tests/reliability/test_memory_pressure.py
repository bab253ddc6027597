"""A page pool far smaller than the working set: every request still finishes with the greedy
output it has with an ample pool (and in transformers), eviction and preemption happen, and
the page accounting holds after every step (check_invariants=True)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv import SamplingParams

from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_engine

PAGE_SIZE = 4


Workload = list[tuple[list[int], int, int]]


def make_workload(seed: int, groups: int = 3, per_group: int = 6, distinct: int = 6) -> Workload:
    """(prompt, max_tokens, n) per request: groups sharing a system prompt of random length
    with distinct tails, plus prompts that share nothing; random output lengths."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(9, 41))] for _ in range(groups)]
    requests = []
    for g in range(groups):
        for _ in range(per_group):
            tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 15))]
            requests.append((systems[g] + tail, rng.randrange(2, 15), 2 if rng.random() < 0.15 else 1))
    for _ in range(distinct):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))]
        requests.append((prompt, rng.randrange(2, 15), 1))
    rng.shuffle(requests)
    return requests


def pages_for(prompt: list[int], max_tokens: int) -> int:
    return -(-(len(prompt) + max_tokens) // PAGE_SIZE)


def run_workload(engine, requests, arrival_steps: list[int]) -> list[list[list[int]]]:
    """Add request i at step arrival_steps[i], step until all end; token ids per continuation."""
    order = sorted(range(len(requests)), key=lambda i: arrival_steps[i])
    ids: dict[int, str] = {}
    finals = {}
    step = 0
    while order or engine.has_unfinished():
        while order and arrival_steps[order[0]] <= step:
            i = order.pop(0)
            prompt, max_tokens, n = requests[i]
            ids[i] = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, n=n))
            engine.check_invariants()
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = delta.output
        step += 1
        assert step < 20_000, engine.stats()
    results = []
    for i in range(len(requests)):
        output = finals[ids[i]]
        assert all(o.finish_reason in ("stop", "length") for o in output.outputs), output
        results.append([o.token_ids for o in output.outputs])
    return results


WORKLOAD = make_workload(seed=11)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """transformers' greedy tokens for each request, cut at its max_tokens."""
    longest = max(max_tokens for _, max_tokens, _ in WORKLOAD)
    full = hf_greedy(tiny_llama, [prompt for prompt, _, _ in WORKLOAD], longest)
    return [tokens[:max_tokens] for tokens, (_, max_tokens, _) in zip(full, WORKLOAD)]


@pytest.mark.parametrize(
    "policy,max_batch_tokens,num_pages,staggered",
    [("lpm", 2048, 18, False), ("fcfs", 2048, 24, True), ("lpm", 10, 20, True)],
    ids=["lpm-all-at-once", "fcfs-staggered", "lpm-chunked-staggered"],
)
def test_small_pool_gives_the_outputs_of_an_ample_one(
    tiny_loaded, reference, policy, max_batch_tokens, num_pages, staggered
):
    assert max(pages_for(p, m) for p, m, _ in WORKLOAD) <= num_pages
    working_set = sum(n * pages_for(p, m) for p, m, n in WORKLOAD)
    assert working_set > 10 * num_pages  # far smaller than what all requests would hold
    arrivals = [(i // 6) * 2 if staggered else 0 for i in range(len(WORKLOAD))]

    ample = make_engine(tiny_loaded, num_pages=1024, policy=policy, max_batch_tokens=max_batch_tokens)
    ample_out = run_workload(ample, WORKLOAD, arrivals)
    small = make_engine(tiny_loaded, num_pages=num_pages, policy=policy, max_batch_tokens=max_batch_tokens)
    small_out = run_workload(small, WORKLOAD, arrivals)

    assert small_out == ample_out
    for continuations, expected in zip(small_out, reference):
        assert all(tokens == expected for tokens in continuations)  # greedy: n copies alike
    stats = small.stats()
    assert stats.num_preemptions > 0, stats
    assert stats.cache.evicted_pages > 0, stats
    assert stats.cache.hit_tokens > 0, stats  # sharing survives the pressure
    assert ample.stats().num_preemptions == 0
    assert_pages_returned(small)
    assert_pages_returned(ample)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    slack_pages=st.integers(0, 6),
    max_batch_tokens=st.sampled_from([7, 16, 2048]),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["lpm", "fcfs"]),
)
def test_random_pressure_is_exact(tiny_loaded, seed, slack_pages, max_batch_tokens, max_num_seqs, policy):
    requests = make_workload(seed, groups=2, per_group=4, distinct=3)
    rng = random.Random(seed)
    arrivals = [rng.randrange(0, 12) for _ in requests]
    # Smallest pool that admits the largest request, plus a little.
    num_pages = max(pages_for(p, m) for p, m, _ in requests) + slack_pages
    options = dict(policy=policy, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs)
    expected = run_workload(make_engine(tiny_loaded, num_pages=1024, **options), requests, arrivals)
    small = make_engine(tiny_loaded, num_pages=num_pages, **options)
    assert run_workload(small, requests, arrivals) == expected
    assert_pages_returned(small)


def test_the_debug_check_catches_a_leaked_page(tiny_loaded):
    """check_invariants=True is only worth its cost if it fails on a broken count."""
    engine = make_engine(tiny_loaded, num_pages=16)
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=8))
    engine.step()
    seq = engine.scheduler.running[0]
    engine.pool.incref(seq.page_table[:1])  # a reference nobody owns: a leak
    with pytest.raises(AssertionError, match="refcount"):
        engine.step()
