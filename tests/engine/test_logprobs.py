"""Logprobs end to end: they equal a log-softmax of transformers' own logits for the same tokens
(guided or not), top lists are sorted and hold the argmax, and deltas add up to the output."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixkv import JsonGuide, SamplingParams
from tests.helpers.engine import assert_pages_returned, make_llm

PROMPTS = ["The quick brown fox", "Question: what is the capital of France?", "def add(a, b):"]
# fp32 on both sides; the forwards differ only in summation order (fused kernels vs eager).
TOLERANCE = 1e-4
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    return model.eval()


def _reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: log-softmax of transformers' logits at each output position."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, logprobs=5),
        SamplingParams(max_tokens=10, logprobs=3, temperature=1.0, seed=4),
        SamplingParams(max_tokens=40, logprobs=2, guide=JsonGuide(json.dumps(SCHEMA))),
    ],
    ids=["greedy", "sampled", "guided"],
)
def test_logprobs_equal_a_log_softmax_of_transformers_logits(llm, hf_model, params):
    for result in llm.generate(PROMPTS, params):
        output = result.outputs[0]
        assert len(output.logprobs) == len(output.token_ids) > 0
        reference = _reference_logprobs(hf_model, result.prompt_token_ids, output.token_ids)
        for position, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(reference[position, token].item(), abs=TOLERANCE)
            values, ids = reference[position].topk(params.logprobs)
            assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
            # Ties within the tolerance may swap places; the ids must be the same set then.
            assert {t for t, _ in entry.top} == set(ids.tolist()) or len(set(values.tolist())) < len(values)
    assert_pages_returned(llm.engine)


def test_guided_logprobs_are_the_models_not_the_grammars(llm):
    # Under a grammar the chosen token is often not the model's favourite: its logprob must
    # then be below the top entry's, as the unmasked distribution says.
    result = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, logprobs=1, guide=JsonGuide(json.dumps(SCHEMA))))[0]
    entries = result.outputs[0].logprobs
    assert any(entry.logprob < entry.top[0][1] - 1e-6 for entry in entries)
    assert all(entry.logprob <= entry.top[0][1] + 1e-6 for entry in entries)


def test_top_lists_are_sorted_and_hold_the_argmax(llm):
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=12, logprobs=20))
    for result in results:
        for entry in result.outputs[0].logprobs:
            values = [lp for _, lp in entry.top]
            assert len(entry.top) == 20
            assert values == sorted(values, reverse=True)
            assert all(lp <= 0.0 for lp in values)
            # Greedy: the chosen token is the argmax, so it leads the list (up to exact ties).
            assert entry.token_id in {t for t, lp in entry.top if lp == values[0]}
            assert entry.logprob == values[0]


def test_logprobs_zero_gives_the_chosen_token_only_and_none_gives_nothing(llm):
    zero, off = llm.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=5, logprobs=0), SamplingParams(max_tokens=5)])
    assert zero.token_ids == off.token_ids
    assert [e.token_id for e in zero.outputs[0].logprobs] == zero.token_ids
    assert all(e.top == [] for e in zero.outputs[0].logprobs)
    assert off.outputs[0].logprobs == []


def test_each_continuation_gets_its_own_top_k_in_a_mixed_batch(llm):
    params = [SamplingParams(max_tokens=6, logprobs=k, temperature=1.0, seed=k, n=2) for k in (1, 4)] + [SamplingParams(max_tokens=6)]
    results = llm.generate(PROMPTS, params)
    for result, p in zip(results, params):
        for output in result.outputs:
            if p.logprobs is None:
                assert output.logprobs == []
            else:
                assert [e.token_id for e in output.logprobs] == output.token_ids
                assert all(len(e.top) == p.logprobs for e in output.logprobs)


def test_deltas_logprobs_add_up_to_the_outputs(llm):
    engine = llm.engine
    ids = [engine.add_request(llm.encode(p), SamplingParams(max_tokens=9, logprobs=3, n=2, temperature=0.8, seed=1)) for p in PROMPTS]
    streamed: dict[tuple[str, int], list] = {(i, k): [] for i in ids for k in range(2)}
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            for completion in delta.completions:
                assert len(completion.logprobs) == len(completion.token_ids)
                streamed[delta.request_id, completion.index].extend(completion.logprobs)
            if delta.finished:
                finals[delta.request_id] = delta.output
    for request_id in ids:
        for output in finals[request_id].outputs:
            assert streamed[request_id, output.index] == output.logprobs
            assert len(output.logprobs) == len(output.token_ids)
    assert_pages_returned(engine)
