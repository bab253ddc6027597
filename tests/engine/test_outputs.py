"""RequestBook: the requests an engine holds, by id. postprocess commits a step, appends the
sampled tokens, finishes what ended and returns one delta per changed request; a request leaves
the book with its last delta, when aborted, or when a step fails one of its rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from radixkv import SamplingParams
from radixkv.attention import make_backend
from radixkv.model.loader import load_model

from tests.helpers.engine import assert_pages_returned, make_engine

PROMPT = [5, 9, 13, 17, 21, 25, 29]


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(str(tiny_llama), make_backend("torch", "cpu"), dtype="float32", device="cpu")


def test_deltas_carry_new_tokens_and_the_last_one_the_output(loaded):
    engine = make_engine(loaded)
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert request_id in engine.requests and len(engine.requests) == 1
    tokens: list[int] = []
    while engine.has_unfinished():
        [delta] = engine.step()
        [completion] = delta.completions
        tokens += completion.token_ids
    assert delta.finished and completion.finish_reason == "length"
    assert delta.output.outputs[0].token_ids == tokens and len(tokens) == 3
    assert request_id not in engine.requests and engine.counters.num_output_tokens == 3
    assert_pages_returned(engine)


def test_a_failed_row_fails_its_whole_request_once_and_frees_its_pages(loaded):
    engine = make_engine(loaded, policy="fcfs")  # lpm would hold the second continuation back a step
    both = engine.add_request(PROMPT, SamplingParams(max_tokens=4, n=2, ignore_eos=True))
    other = engine.add_request([8, 6, 4, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    batch = engine.scheduler.schedule()
    result = engine.runner.run(batch)
    rows = [seq.request_id for seq in result.seqs]
    assert sorted(rows) == sorted([both, both, other])
    broken = replace(result, failed={rows.index(both): ValueError("row 1")})
    deltas = engine.requests.postprocess(batch, broken)
    assert [delta.request_id for delta in deltas] == [other]
    [(failed_id, error)] = engine.take_failed()
    assert failed_id == both and str(error) == "row 1" and both not in engine.requests
    assert engine.abort(both) is None  # gone already
    while engine.has_unfinished():
        engine.step()
    assert_pages_returned(engine)


def test_abort_ends_every_continuation_with_reason_abort(loaded):
    engine = make_engine(loaded)
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=8, n=2))
    engine.step()
    delta = engine.abort(request_id)
    assert delta is not None and delta.finished
    assert [c.finish_reason for c in delta.completions] == ["abort", "abort"]
    assert not engine.has_unfinished() and engine.num_unfinished == 0
    assert_pages_returned(engine)
