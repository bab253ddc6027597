"""Aborts at every stage — waiting, waiting again after a preemption, mid-prefill chunk,
decoding, after finishing — give back exactly the page references the request held, and the
requests left running still produce their exact greedy tokens. A state machine drives random
submit/step/abort sequences; the engine checks its page accounting after every step."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from radixkv import SamplingParams
from radixkv.engine.request import SeqStatus

from .conftest import VOCAB, assert_pages_returned, held_pages, make_engine, refcounts, run_to_end

_rng = random.Random(3)
SYSTEM = [_rng.randrange(1, VOCAB) for _ in range(40)]
PREFIXES = [SYSTEM[:30], SYSTEM[:13], []]  # hypothesis favours the first: the long one


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

# (shared prefix index, tail length, max_tokens, n); tails are random, so prompts differ.
SUBMIT = st.tuples(st.sampled_from(range(len(PREFIXES))), st.integers(1, 10), st.sampled_from([16, 12, 8, 3, 1]), st.sampled_from([1, 2, 1]))
# Which kind of request to abort, and which one of that kind.
ABORT = st.tuples(st.sampled_from(["running", "waiting", "ended"]), st.integers(0, 1000))
# A round: submit some, step some, abort some.
ROUND = st.tuples(st.lists(SUBMIT, max_size=4), st.sampled_from([3, 0, 1, 6, 12]), st.lists(ABORT, max_size=2))

def stage_of(engine, request_id: str, finished: dict) -> str:
    seqs = engine._requests.get(request_id)
    if seqs is None:
        return "after finishing" if request_id in finished else "unknown or aborted"
    seq = seqs[0]
    if seq.status is SeqStatus.WAITING:
        return "waiting after preemption" if seq.num_preemptions else "waiting"
    if seq.num_computed_tokens < len(seq.prompt_token_ids):
        return "mid-prefill"
    return "decoding"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = [o.token_ids for o in output.outputs]
        for kind, pick in aborts:
            running = sorted({seq.request_id for seq in engine.scheduler.running})
            waiting = sorted({seq.request_id for seq in engine.scheduler.waiting} - set(running))
            ended = [*sorted(set(requests) - set(engine._requests)), "unknown"]
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
