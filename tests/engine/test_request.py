"""The request contract between any caller and the engine: max_tokens None is the room the
context leaves (filled per request by the engine), the context is checked by the engine alone
with one message, and a seed is any 64-bit integer, signed or unsigned."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv import LLM, InvalidRequest, SamplingParams
from radixkv.engine.sampling_params import MAX_SEED, MIN_SEED
from tests.helpers.engine import assert_pages_returned, make_llm, run_to_end

CONTEXT = 64


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return make_llm(tiny_llama, page_size=4, num_pages=128, max_model_len=CONTEXT)


def test_max_tokens_none_is_the_room_left_for_each_request(llm: LLM) -> None:
    engine = llm.engine
    shared = SamplingParams(max_tokens=None, ignore_eos=True)
    short, long = [5] * 10, [6] * 50
    ids = [engine.add_request(short, shared), engine.add_request(long, shared)]
    assert shared.max_tokens is None  # the caller's params are left as they were
    finals = run_to_end(engine)
    assert [len(finals[i].token_ids) for i in ids] == [CONTEXT - 10, CONTEXT - 50]
    assert all(finals[i].finish_reason == "length" for i in ids)
    assert_pages_returned(engine)


def test_the_engine_alone_checks_the_context_with_one_message(llm: LLM) -> None:
    engine = llm.engine
    engine.check_request([5] * (CONTEXT - 1), SamplingParams(max_tokens=None))  # room for one token
    with pytest.raises(InvalidRequest) as full:
        engine.check_request([5] * CONTEXT, SamplingParams(max_tokens=None))
    assert (full.value.param, full.value.code, full.value.limit) == ("prompt", "context_length_exceeded", CONTEXT)
    assert full.value.message.startswith(f"this model's maximum context length is {CONTEXT} tokens; ")
    with pytest.raises(InvalidRequest) as over:
        engine.add_request([5] * 10, SamplingParams(max_tokens=CONTEXT - 9))
    assert (over.value.param, over.value.code, over.value.limit) == ("max_tokens", "context_length_exceeded", CONTEXT)
    assert over.value.message.startswith(f"this model's maximum context length is {CONTEXT} tokens; ")
    assert not engine.has_unfinished()


@pytest.mark.parametrize("seed", [MIN_SEED, -1, 0, (1 << 63) - 1, 1 << 63, MAX_SEED])
def test_any_64_bit_seed_is_accepted_and_reproducible(llm: LLM, seed: int) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    first, again = llm.generate([[5, 6, 7], [5, 6, 7]], params)
    assert first.token_ids == again.token_ids


@pytest.mark.parametrize("seed", [MIN_SEED - 1, MAX_SEED + 1, 1 << 70])
def test_a_seed_past_64_bits_is_refused(seed: int) -> None:
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(seed=seed)
    assert refused.value.param == "seed"
