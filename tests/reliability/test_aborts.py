"""Aborts at every stage — waiting, waiting again after a preemption, mid-prefill chunk,
decoding, after finishing — give back exactly the page references the request held, and the
requests left running still produce their exact greedy tokens. A state machine drives random
submit/abort/step sequences; the engine checks its page accounting after every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radixkv import SamplingParams
from radixkv.engine.request import SeqStatus

from .conftest import VOCAB, assert_pages_returned, held_pages, make_engine, refcounts, run_to_end

_rng = random.Random(3)
SYSTEM = [_rng.randrange(1, VOCAB) for _ in range(40)]
PREFIXES = [[], SYSTEM[:13], SYSTEM[:26]]


def abort_and_check(engine, request_id: str):
    """Abort; every page reference the request held, and only those, is dropped."""
    held = held_pages(engine, request_id) if request_id in engine._requests else Counter()
    before, free_before = refcounts(engine), engine.pool.free_pages()
    cached_before = engine.tree.cached_page_set()
    output = engine.abort(request_id)
    expected = list(before)
    for page, count in held.items():
        expected[page] -= count
    assert refcounts(engine) == expected
    assert engine.pool.free_pages() - free_before == {p for p, c in held.items() if before[p] == c}
    assert free_before <= engine.pool.free_pages()
    assert engine.tree.cached_page_set() == cached_before  # computed blocks stay cached
    assert request_id not in engine._requests
    engine.check_invariants()
    return output


def reference_tokens(loaded, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy tokens of each (prompt, max_tokens), run on an ample pool with no aborts."""
    engine = make_engine(loaded, num_pages=1024)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in requests]
    finals = run_to_end(engine)
    return [finals[i].token_ids for i in ids]


def test_abort_while_waiting(tiny_loaded):
    engine = make_engine(tiny_loaded, max_num_seqs=1)
    a = engine.add_request(SYSTEM[:30], SamplingParams(max_tokens=8))
    b = engine.add_request(SYSTEM[:20] + [7, 8], SamplingParams(max_tokens=8))
    engine.step()
    [seq_b] = engine._requests[b]
    assert seq_b.status is SeqStatus.WAITING and not seq_b.page_table
    output = abort_and_check(engine, b)
    assert output.finished and output.finish_reason == "abort" and output.token_ids == []
    finals = run_to_end(engine)
    assert finals[a].token_ids == reference_tokens(tiny_loaded, [(SYSTEM[:30], 8)])[0]
    assert_pages_returned(engine)


def test_abort_while_waiting_after_a_preemption(tiny_loaded):
    rng = random.Random(5)
    requests = [(SYSTEM[: rng.randrange(10, 40)] + [rng.randrange(1, VOCAB) for _ in range(5)], 12) for _ in range(8)]
    engine = make_engine(tiny_loaded, num_pages=16)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in requests]
    victim = None
    for _ in range(500):
        engine.step()
        preempted = [s for s in engine.scheduler.waiting if s.num_preemptions and s.output_token_ids]
        if preempted:
            victim = preempted[0]
            break
    assert victim is not None, engine.stats()
    assert not victim.page_table and victim.tree_node is None  # a preempted sequence holds nothing
    output = abort_and_check(engine, victim.request_id)
    assert output.finish_reason == "abort" and output.token_ids == victim.output_token_ids
    finals = run_to_end(engine)
    expected = reference_tokens(tiny_loaded, requests)
    for i, request_id in enumerate(ids):
        if request_id == victim.request_id:
            assert expected[i][: len(output.token_ids)] == output.token_ids
        else:
            assert finals[request_id].token_ids == expected[i]
    assert_pages_returned(engine)


def test_abort_mid_prefill_chunk_keeps_its_computed_blocks_for_others(tiny_loaded):
    engine = make_engine(tiny_loaded, max_batch_tokens=8)
    a = engine.add_request(SYSTEM + [1, 2, 3], SamplingParams(max_tokens=6))
    engine.step()
    engine.step()
    [seq_a] = engine._requests[a]
    assert seq_a.status is SeqStatus.RUNNING and seq_a.num_computed_tokens == 16 < len(seq_a.prompt_token_ids)
    assert engine.tree.cached_pages == 4 and engine.tree.locked_pages == 4
    abort_and_check(engine, a)
    assert engine.tree.cached_pages == 4 and engine.tree.locked_pages == 0
    b_prompt = SYSTEM[:30] + [9, 9]
    b = engine.add_request(b_prompt, SamplingParams(max_tokens=6))
    finals = run_to_end(engine)
    assert finals[b].num_cached_tokens == 16  # the aborted request's chunks served it
    assert finals[b].token_ids == reference_tokens(tiny_loaded, [(b_prompt, 6)])[0]
    assert_pages_returned(engine)


def test_abort_the_owner_of_blocks_another_request_is_reading(tiny_loaded):
    engine = make_engine(tiny_loaded, max_batch_tokens=12, policy="fcfs")
    prompts = [SYSTEM + [5, 6], SYSTEM + list(range(100, 130))]
    a, b = (engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts)
    [seq_a], [seq_b] = engine._requests[a], engine._requests[b]
    for _ in range(10):
        engine.step()
        if set(seq_a.page_table) & set(seq_b.page_table):
            break
    assert set(seq_a.page_table) & set(seq_b.page_table), "b should be reading a's blocks"
    assert seq_b.num_computed_tokens < len(seq_b.prompt_token_ids)  # b is mid-prefill on them
    abort_and_check(engine, a)
    finals = run_to_end(engine)
    assert finals[b].token_ids == reference_tokens(tiny_loaded, [(prompts[1], 8)])[0]
    assert_pages_returned(engine)


def test_abort_while_decoding_all_continuations(tiny_loaded):
    engine = make_engine(tiny_loaded)
    prompt = SYSTEM[:23]
    a = engine.add_request(prompt, SamplingParams(max_tokens=16, n=3, ignore_eos=True))
    other = engine.add_request(SYSTEM[:17], SamplingParams(max_tokens=16))
    while len(engine._requests[a][0].output_token_ids) < 5:
        engine.step()
    assert all(s.status is SeqStatus.RUNNING and s.output_token_ids for s in engine._requests[a])
    output = abort_and_check(engine, a)
    assert [o.finish_reason for o in output.outputs] == ["abort"] * 3
    expected = reference_tokens(tiny_loaded, [(prompt, 16), (SYSTEM[:17], 16)])
    assert all(o.token_ids == expected[0][: len(o.token_ids)] for o in output.outputs)
    assert run_to_end(engine)[other].token_ids == expected[1]
    assert_pages_returned(engine)


def test_abort_after_finishing_and_of_unknown_ids_changes_nothing(tiny_loaded):
    engine = make_engine(tiny_loaded)
    a = engine.add_request(SYSTEM[:9], SamplingParams(max_tokens=3))
    run_to_end(engine)
    before = refcounts(engine)
    assert engine.abort(a) is None
    assert engine.abort("no-such-request") is None
    assert refcounts(engine) == before
    assert_pages_returned(engine)


# -- random sequences of submit / step / abort ----------------------------------------------

_LOADED = None  # set by the test below: state machines are built by hypothesis, not by pytest


class SubmitAbortStep(RuleBasedStateMachine):
    @initialize(
        num_pages=st.integers(14, 40),
        max_batch_tokens=st.sampled_from([5, 8, 16, 512]),
        max_num_seqs=st.integers(1, 6),
        policy=st.sampled_from(["lpm", "fcfs"]),
    )
    def start(self, num_pages, max_batch_tokens, max_num_seqs, policy):
        self.engine = make_engine(
            _LOADED, num_pages=num_pages, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs, policy=policy
        )
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.finished: dict[str, list[int]] = {}
        self.aborted: dict[str, list[list[int]]] = {}

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        tail=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10),
        max_tokens=st.integers(1, 10),
        n=st.sampled_from([1, 1, 1, 2]),
    )
    def submit(self, prefix, tail, max_tokens, n):
        prompt = PREFIXES[prefix] + tail
        request_id = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, n=n))
        self.requests[request_id] = (prompt, max_tokens)

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            for output in self.engine.step():
                if output.finished:
                    self.finished[output.request_id] = [o.token_ids for o in output.outputs]

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(data=st.data())
    def abort_live(self, data):
        self._abort(data.draw(st.sampled_from(sorted(self.engine._requests))))

    @rule(data=st.data())
    def abort_ended_or_unknown(self, data):
        self._abort(data.draw(st.sampled_from([*sorted(set(self.requests) - set(self.engine._requests)), "unknown"])))

    def _abort(self, request_id: str) -> None:
        event(f"abort: {self._stage(request_id)}")
        output = abort_and_check(self.engine, request_id)
        if output is not None:
            self.aborted[request_id] = [o.token_ids for o in output.outputs]

    def _stage(self, request_id: str) -> str:
        seqs = self.engine._requests.get(request_id)
        if seqs is None:
            return "finished" if request_id in self.finished else "unknown or aborted"
        seq = seqs[0]
        if seq.status is SeqStatus.WAITING:
            return "waiting after preemption" if seq.num_preemptions else "waiting"
        if seq.status is SeqStatus.RUNNING and seq.num_computed_tokens < len(seq.prompt_token_ids):
            return "mid-prefill"
        return "decoding"

    @invariant()
    def pages_consistent(self):
        self.engine.check_invariants()

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for output in run_to_end(engine).values():
            self.finished[output.request_id] = [o.token_ids for o in output.outputs]
        assert_pages_returned(engine)
        assert set(self.finished) | set(self.aborted) == set(self.requests)
        ids = list(self.requests)
        expected = dict(zip(ids, reference_tokens(_LOADED, [self.requests[i] for i in ids])))
        for request_id, continuations in self.finished.items():
            assert all(tokens == expected[request_id] for tokens in continuations), request_id
        for request_id, continuations in self.aborted.items():
            assert all(tokens == expected[request_id][: len(tokens)] for tokens in continuations), request_id


def test_random_submit_abort_step_sequences(tiny_loaded):
    global _LOADED
    _LOADED = tiny_loaded
    run_state_machine_as_test(
        SubmitAbortStep,
        settings=settings(
            max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


@pytest.fixture(autouse=True)
def _no_leftover_machine():
    yield
    global _LOADED
    _LOADED = None
