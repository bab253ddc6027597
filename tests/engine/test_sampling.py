"""Sampling parameters end to end: seeds, n, stops, lengths, and invalid values."""

from __future__ import annotations

import pytest
import torch

from radixkv import LLM, InvalidRequest, SamplingParams
from radixkv.engine.sampler import filtered_probs
from tests.helpers.engine import assert_pages_returned


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", device="cpu", page_size=4, num_pages=128, check_invariants=True)


PROMPT = "The quick brown fox jumps over the lazy dog."


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = llm.generate([PROMPT], params)[0].token_ids
    crowd = llm.generate(["other text", PROMPT, "more text"], [SamplingParams(max_tokens=10, temperature=1.0), params, params])
    assert crowd[1].token_ids == alone
    other_seed = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=99))[0].token_ids
    assert other_seed != alone
    assert_pages_returned(llm.engine)


def test_n_continuations_share_the_prompt(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=6, n=3))[0]
    assert len(greedy.outputs) == 3
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    sampled = llm.generate([PROMPT], SamplingParams(max_tokens=8, n=4, temperature=1.5, seed=5))[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    assert_pages_returned(llm.engine)


def test_max_tokens_and_stop_strings(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    stop = base.text[3:6]
    assert stop
    stopped = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == base.text[: base.text.find(stop)]


def test_stop_token_ids(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stopped = llm.generate([PROMPT], SamplingParams(max_tokens=8, stop_token_ids=[base.token_ids[2]]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[2]) + 1]


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8))[0].token_ids
    top1 = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=3))[0].token_ids
    assert top1 == greedy


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n must"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_params_name_the_limit(options, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        SamplingParams(**options)


def test_prompts_over_the_context_are_refused_and_the_engine_goes_on(llm):
    with pytest.raises(InvalidRequest, match="maximum context length is 512"):
        llm.generate([[5] * 600])
    with pytest.raises(InvalidRequest, match="max_tokens"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=510))
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([[]])
    with pytest.raises(InvalidRequest, match=r"\[0, 320\)"):
        llm.generate([[5, 999]])
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2))[0].finish_reason is not None
    assert_pages_returned(llm.engine)


def test_draws_follow_the_distribution_with_and_without_top_p():
    # 20,000 draws of one row per sequence from a known distribution: each token's frequency is
    # within 5 standard errors of its probability; top-p's cut tokens are never drawn.
    from types import SimpleNamespace

    import torch

    from radixkv.engine.sampler import Sampler

    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0]) + 1e-30)
    for top_p, expected in ((1.0, [0.4, 0.3, 0.15, 0.1, 0.05]), (0.8, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])):
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=1)
        seqs = [SimpleNamespace(params=params, generator=None, index=i, seq_id=i) for i in range(20_000)]
        tokens = Sampler()._draw(logits.expand(len(seqs), -1).clone(), seqs)
        counts = torch.bincount(tokens, minlength=8).double() / len(seqs)
        for token, p in enumerate(expected + [0.0, 0.0, 0.0]):
            tolerance = 5 * (p * (1 - p) / len(seqs)) ** 0.5 + 1e-12
            assert abs(counts[token].item() - p) <= tolerance, (top_p, token, counts.tolist())
