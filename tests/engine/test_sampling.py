"""Sampling parameters end to end: seeds, n, stops, lengths, and invalid values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import LLM, InvalidRequest, SamplingParams
from radixkv.cpu import native
from radixkv.cpu.logits import nonfinite_rows
from radixkv.engine.sampler import filtered_probs, greedy_tokens
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


@pytest.mark.parametrize("scale", [1.5, 6.0])  # flat rows (nucleus past the candidates) and peaked ones
def test_the_candidate_shortcut_gives_the_full_sorts_probabilities(scale, monkeypatch):
    import torch

    from radixkv.engine import sampler

    torch.manual_seed(int(scale))
    logits = torch.randn(3, 49152) * scale
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=50, top_p=0.95), SamplingParams(temperature=1.3, top_k=256)]

    def in_vocab_order(probs, order):
        return torch.zeros(logits.shape).scatter_(-1, order, probs)

    shortcut = in_vocab_order(*sampler.sorted_filtered_probs(logits, params))
    monkeypatch.setattr(sampler, "CANDIDATES", logits.shape[1])  # no shortcut: the whole sort
    whole = in_vocab_order(*sampler.sorted_filtered_probs(logits, params))
    torch.testing.assert_close(shortcut, whole, atol=1e-6, rtol=0)


SPECIALS = (float("nan"), float("inf"), -float("inf"), -0.0, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 90),  # under and over one 16-float vector, with tails
    levels=st.integers(1, 6),  # few distinct values: many ties
    special_rate=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**32 - 1),
)
def test_greedy_tokens_follow_torch_max(rows, width, levels, special_rate, seed) -> None:
    """The native argmax keeps torch's semantics: the first of equal maxima, a NaN above every
    number, +-inf and signed zeros as they compare."""
    assert native.load() is not None  # the native kernel runs, not the torch fallback
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-levels, levels + 1, (rows, width + 3), generator=gen).float()
    special = torch.rand(logits.shape, generator=gen) < special_rate
    picks = torch.randint(0, len(SPECIALS), logits.shape, generator=gen)
    logits[special] = torch.tensor(SPECIALS)[picks[special]]
    strided = logits[:, 1 : width + 1]  # rows one stride apart, not contiguous
    assert torch.equal(greedy_tokens(strided), strided.max(dim=-1).indices)
    assert torch.equal(greedy_tokens(logits), logits.max(dim=-1).indices)


def test_greedy_tokens_of_a_full_vocabulary() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 49152, generator=gen)
    logits[5, 40000] = logits[5, 7] = logits[5].max() + 1.0  # a tie: the first wins
    logits[9, 30000] = float("nan")
    logits[11] = -float("inf")  # a row every token of which a grammar masked
    expected = logits.max(dim=-1).indices
    assert expected[5] == 7 and expected[9] == 30000 and expected[11] == 0
    assert torch.equal(greedy_tokens(logits), expected)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 90),
    special_rate=st.sampled_from([0.0, 0.01, 0.3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_nonfinite_rows_are_the_rows_with_a_nan_or_an_infinity(rows, width, special_rate, seed) -> None:
    """The native pass over the bits flags exactly the rows torch's isfinite finds a non-finite
    value in, NaNs of any payload and both infinities, largest finite floats and zeros not."""
    assert native.load() is not None
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width + 3, generator=gen) * 1e38  # overflows a row sum, yet finite
    special = torch.rand(logits.shape, generator=gen) < special_rate
    picks = torch.randint(0, len(SPECIALS), logits.shape, generator=gen)
    logits[special] = torch.tensor(SPECIALS)[picks[special]]
    logits.view(torch.int32)[0, 0] = 0x7FC00123 if seed % 2 else 0x7F7FFFFF  # a NaN with a payload, the largest float
    strided = logits[:, 1 : width + 1]
    for rows_of in (strided, logits):
        assert torch.equal(nonfinite_rows(rows_of), ~torch.isfinite(rows_of).all(dim=-1))


def test_a_full_batch_of_nonfinite_rows() -> None:
    """Past the kernel's one-thread size: the rows split over threads, each flag its own row's."""
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(4))
    logits[3, 49151], logits[17, 0], logits[30, 20000] = float("inf"), float("nan"), -float("inf")
    assert nonfinite_rows(logits).nonzero().flatten().tolist() == [3, 17, 30]


def test_logit_bias_steers_greedy_and_sampled_rows(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    forced = next(t for t in range(5, 300) if t not in base)
    for params in (SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={forced: 100}),
                   SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={forced: 100}, temperature=1.0, seed=3)):  # fmt: skip
        assert llm.generate([PROMPT], params)[0].token_ids == [forced] * 6
    # A ban (-100) on the greedy first token moves greedy to another one.
    banned = llm.generate([PROMPT], SamplingParams(max_tokens=1, ignore_eos=True, logit_bias={base[0]: -100}))[0].token_ids
    assert banned[0] != base[0]
    assert_pages_returned(llm.engine)


def test_a_steered_row_leaves_its_neighbours_tokens_alone(llm):
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = llm.generate(["other text", "more text"], plain)
    steered = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={7: 100}, min_tokens=3)
    crowd = llm.generate(["other text", PROMPT, "more text"], [plain, steered, plain])
    assert [crowd[0].token_ids, crowd[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]


def test_ignore_eos_and_min_tokens_hold_back_the_end(llm):
    eos = llm.engine.tokenizer.eos_token_id
    ends = SamplingParams(max_tokens=8, logit_bias={eos: 100})
    assert llm.generate([PROMPT], ends)[0].token_ids == [eos]  # the end comes first
    through = llm.generate([PROMPT], SamplingParams(max_tokens=8, logit_bias={eos: 100}, ignore_eos=True))[0]
    assert len(through.token_ids) == 8 and through.finish_reason == "length"
    floor = llm.generate([PROMPT], SamplingParams(max_tokens=8, logit_bias={eos: 100}, min_tokens=5))[0]
    assert len(floor.token_ids) == 6 and eos not in floor.token_ids[:5] and floor.token_ids[5] == eos
    assert floor.finish_reason == "stop"
    # A stop token id is held back by min_tokens as the end token is.
    stop_id = next(t for t in range(5, 300) if t != eos)
    held = llm.generate([PROMPT], SamplingParams(max_tokens=8, logit_bias={stop_id: 100}, stop_token_ids=[stop_id], min_tokens=3))[0]
    assert len(held.token_ids) == 4 and held.token_ids[3] == stop_id and stop_id not in held.token_ids[:3]
    assert_pages_returned(llm.engine)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (dict(logit_bias=dict.fromkeys(range(301), 1.0)), "logit_bias"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(stop_token_ids=list(range(65))), "stop_token_ids"),
        (dict(min_tokens=9, max_tokens=8), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_token_controls_are_capped_where_they_are_made(options, param):
    with pytest.raises(InvalidRequest) as error:
        SamplingParams(**options)
    assert error.value.param == param


@pytest.mark.parametrize(("options", "param"), [(dict(logit_bias={320: 1.0}), "logit_bias"), (dict(stop_token_ids=[5, 320]), "stop_token_ids")])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_work(llm, options, param):
    with pytest.raises(InvalidRequest) as error:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **options))
    assert error.value.param == param and error.value.limit == 320
    assert_pages_returned(llm.engine)


def test_a_request_preempted_for_priority_gives_the_tokens_it_gives_alone(tiny_llama):
    # One sequence at a time: the batch job runs, the interactive request (priority -1) takes
    # its seat; both finish with the tokens each gives alone, and every page comes back.
    from tests.helpers.engine import run_to_end

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", page_size=4, num_pages=128, max_num_seqs=1, check_invariants=True)
    engine = llm.engine
    long_job = SamplingParams(max_tokens=20, ignore_eos=True, priority=3)
    urgent = SamplingParams(max_tokens=5, ignore_eos=True, priority=-1)
    alone = [llm.generate([prompt], params)[0].token_ids for prompt, params in (("batch job text", long_job), (PROMPT, urgent))]
    job_id = engine.add_request(engine.tokenizer.encode("batch job text"), long_job)
    for _ in range(4):
        engine.step()
    urgent_id = engine.add_request(engine.tokenizer.encode(PROMPT), urgent)
    finals = run_to_end(engine)
    assert [finals[job_id].outputs[0].token_ids, finals[urgent_id].outputs[0].token_ids] == alone
    assert list(finals) == [urgent_id, job_id]  # the interactive request finished first
    assert engine.scheduler.num_preemptions == 1
    assert_pages_returned(engine)


def test_a_steered_row_gives_the_same_tokens_alone_and_in_a_batch(llm):
    # The bias is applied once, in the batch pass: alone (one row) it was applied twice when
    # the in-place add on the forward's inference tensor failed and the row-by-row fallback ran.
    params = SamplingParams(max_tokens=7, ignore_eos=True, logit_bias={9: 5.0}, min_tokens=3)
    prompts = ["hello there", "the quick brown", "a b c d e"]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert batched == [llm.generate([p], params)[0].token_ids for p in prompts]
