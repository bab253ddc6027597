"""Aborts at every stage — waiting, waiting again after a preemption, mid-prefill chunk,
decoding, after finishing — give back exactly the page references the request held, and the
requests left running still produce their exact greedy tokens. Hypothesis drives random rounds
of submit, step and abort; the engine checks its page accounting after every step. A step that
fails (an injected fault) loses no page either."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from radixkv import SamplingParams
from radixkv.engine.request import SeqStatus

from tests.helpers.engine import VOCAB, assert_pages_returned, held_pages, make_engine, refcounts, run_to_end

_rng = random.Random(3)
SYSTEM = [_rng.randrange(1, VOCAB) for _ in range(40)]
PREFIXES = [SYSTEM[:30], SYSTEM[:13], []]  # hypothesis favours the first: the long one


def abort_and_check(engine, request_id: str):
    """Abort; every page reference the request held, and only those, is dropped."""
    held = held_pages(engine, request_id) if request_id in engine.requests else Counter()
    before, free_before = refcounts(engine), engine.pool.free_pages()
    cached_before = engine.tree.cached_page_set()
    delta = engine.abort(request_id)
    expected = list(before)
    for page, count in held.items():
        expected[page] -= count
    assert refcounts(engine) == expected
    assert engine.pool.free_pages() - free_before == {p for p, c in held.items() if before[p] == c}
    assert free_before <= engine.pool.free_pages()
    assert engine.tree.cached_page_set() == cached_before  # computed blocks stay cached
    assert request_id not in engine.requests
    engine.check_invariants()
    return delta.output if delta is not None else None


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
    [seq_b] = engine.requests[b]
    assert seq_b.status is SeqStatus.WAITING and not seq_b.page_table
    output = abort_and_check(engine, b)
    assert output.finish_reason == "abort" and output.token_ids == []
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
    [seq_a] = engine.requests[a]
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
    [seq_a], [seq_b] = engine.requests[a], engine.requests[b]
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
    while len(engine.requests[a][0].output_token_ids) < 5:
        engine.step()
    assert all(s.status is SeqStatus.RUNNING and s.output_token_ids for s in engine.requests[a])
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

# (shared prefix index, tail length, max_tokens, n); tails are random, so prompts differ.
SUBMIT = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.integers(1, 10),
    st.sampled_from([16, 12, 8, 3, 1]),
    st.sampled_from([1, 2, 1]),
)
# Which kind of request to abort, and which one of that kind.
ABORT = st.tuples(st.sampled_from(["running", "waiting", "ended"]), st.integers(0, 1000))
# A round: submit some, step some, abort some.
ROUND = st.tuples(st.lists(SUBMIT, max_size=4), st.sampled_from([3, 0, 1, 6, 12]), st.lists(ABORT, max_size=2))


def stage_of(engine, request_id: str, finished: dict) -> str:
    seqs = engine.requests.get(request_id)
    if seqs is None:
        return "after finishing" if request_id in finished else "unknown or aborted"
    seq = seqs[0]
    if seq.status is SeqStatus.WAITING:
        return "waiting after preemption" if seq.num_preemptions else "waiting"
    if seq.num_computed_tokens < len(seq.prompt_token_ids):
        return "mid-prefill"
    return "decoding"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_pages=st.integers(14, 18),  # the longest request (40 + 16 tokens) needs 14 pages of 4
    max_batch_tokens=st.sampled_from([16, 512, 7]),
    max_num_seqs=st.sampled_from([8, 3, 1]),
    policy=st.sampled_from(["lpm", "fcfs"]),
    rounds=st.lists(ROUND, min_size=3, max_size=10),
)
def test_random_submit_abort_step_sequences(tiny_loaded, num_pages, max_batch_tokens, max_num_seqs, policy, rounds):
    engine = make_engine(
        tiny_loaded, num_pages=num_pages, max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs, policy=policy
    )
    requests: dict[str, tuple[list[int], int]] = {}
    finished: dict[str, list[list[int]]] = {}
    aborted: dict[str, list[list[int]]] = {}

    for submits, steps, aborts in rounds:
        for prefix, tail_len, max_tokens, n in submits:
            rng = random.Random(len(requests))
            prompt = PREFIXES[prefix] + [rng.randrange(1, VOCAB) for _ in range(tail_len)]
            requests[engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, n=n))] = (prompt, max_tokens)
            engine.check_invariants()
        for _ in range(steps):
            for delta in engine.step():
                if delta.finished:
                    finished[delta.request_id] = [o.token_ids for o in delta.output.outputs]
        for kind, pick in aborts:
            running = sorted({seq.request_id for seq in engine.scheduler.running})
            waiting = sorted({seq.request_id for seq in engine.scheduler.waiting} - set(running))
            ended = [*sorted(set(requests) - set(engine.requests)), "unknown"]
            candidates = {"running": running, "waiting": waiting, "ended": ended}[kind] or ended
            request_id = candidates[pick % len(candidates)]
            event(f"abort {stage_of(engine, request_id, finished)}")
            output = abort_and_check(engine, request_id)
            if output is not None:
                aborted[request_id] = [o.token_ids for o in output.outputs]

    event(f"preempted: {engine.scheduler.num_preemptions > 0}")
    for output in run_to_end(engine).values():
        finished[output.request_id] = [o.token_ids for o in output.outputs]
    assert_pages_returned(engine)
    assert set(finished) | set(aborted) == set(requests) and not set(finished) & set(aborted)
    ids = list(requests)
    expected = dict(zip(ids, reference_tokens(tiny_loaded, [requests[i] for i in ids])))
    for request_id, continuations in finished.items():
        assert all(tokens == expected[request_id] for tokens in continuations), request_id
    for request_id, continuations in aborted.items():
        assert all(tokens == expected[request_id][: len(tokens)] for tokens in continuations), request_id


# -- faults: a step that fails ---------------------------------------------------------------


class FailingForward:
    """Wraps runner.forward; raises on the calls numbered in `fail_on` (1-based)."""

    def __init__(self, runner, fail_on: set[int]) -> None:
        self.real, self.fail_on, self.calls = runner.forward, fail_on, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected fault: out of memory")
        return self.real(*args)


def pressure_requests(seed: int, count: int = 6) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(SYSTEM[: rng.randrange(8, 40)] + [rng.randrange(1, VOCAB) for _ in range(4)], 10) for _ in range(count)]


def test_a_failed_step_then_aborting_everything_returns_every_page(tiny_loaded):
    """What AsyncEngine does when a step raises: abort every request. Under pressure, at a step
    that had admitted, grown and preempted sequences before the forward failed."""
    requests = pressure_requests(1)
    engine = make_engine(tiny_loaded, num_pages=18, max_batch_tokens=24)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in requests]
    for _ in range(10):
        engine.step()
    assert engine.stats().num_preemptions > 0 and engine.scheduler.running and engine.scheduler.waiting
    engine.runner.forward = FailingForward(engine.runner, {1})
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    unfinished = engine.num_unfinished
    assert 0 < unfinished <= len(ids) and engine.abort_all() == unfinished
    assert_pages_returned(engine)
    del engine.runner.forward
    again = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in requests]
    finals = run_to_end(engine)
    assert [finals[i].token_ids for i in again] == reference_tokens(tiny_loaded, requests)
    assert_pages_returned(engine)


def test_stepping_on_after_failed_steps_keeps_outputs_exact(tiny_loaded):
    """A transient fault (the forward raises, nothing is aborted) leaves a state the next step
    can carry on from: no page leaks, and every output is the one without the fault."""
    requests = pressure_requests(2)
    engine = make_engine(tiny_loaded, num_pages=18, max_batch_tokens=24)
    ids = [engine.add_request(p, SamplingParams(max_tokens=m)) for p, m in requests]
    engine.runner.forward = FailingForward(engine.runner, {2, 5, 6, 11, 20})
    finals = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except RuntimeError:
            engine.check_invariants()
            continue
        finals.update({d.request_id: d.output for d in outputs if d.finished})
    assert engine.runner.forward.calls > 20 and engine.stats().num_preemptions > 0
    assert [finals[i].token_ids for i in ids] == reference_tokens(tiny_loaded, requests)
    assert_pages_returned(engine)


def test_a_failing_step_on_the_server_ends_requests_cleanly(live):
    """Streams in flight when a step fails end with an error event (not a hang, not a lost
    request); the server then serves the next requests and no page is left behind."""
    engine = live.async_engine.engine
    live.engine_call(lambda e: setattr(e.runner, "forward", FailingForward(e.runner, {4})))
    try:
        bodies = [
            {"model": "tiny-llama", "prompt": f"Fault {i}: the quick brown fox", "max_tokens": 20, "temperature": 0,
             "stream": i % 2 == 0}
            for i in range(4)
        ]  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        def send(body):
            with live.http(timeout_s=60) as client:
                return client.post("/v1/completions", json=body)

        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(send, bodies))
    finally:
        live.engine_call(lambda e: e.runner.__dict__.pop("forward", None))
    failed = 0
    for body, response in zip(bodies, responses):
        if body["stream"]:
            assert response.status_code == 200
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            if events[-1] != "[DONE]":
                failed += 1
                assert "engine_error" in events[-1], events[-1]
        elif response.status_code != 200:
            failed += 1
            assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    assert failed >= 1
    live.assert_idle_and_consistent()
    with live.http() as client:
        ok = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "after the fault", "max_tokens": 3})
    assert ok.status_code == 200
    assert engine.runner.forward.__self__ is engine.runner  # the real method is back
