"""ModelRunner.run: one batch prepared, run, guarded and sampled into a typed StepResult; a row
that breaks (non-finite logits, a sampler error) is reported as failed, never raised, and the
other rows sample as they would alone. Sampler.sample_batch's row-by-row fallback."""

from __future__ import annotations

import pytest
import torch

from radixkv.attention import make_backend
from radixkv.engine.runner import StepResult
from radixkv.engine.sampler import Sampler
from radixkv.model.loader import load_model
from radixkv import SamplingParams

from tests.helpers.engine import make_engine, run_to_end

PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [7, 11, 15, 19]]


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_model(str(tiny_llama), make_backend("torch", "cpu"), dtype="float32", device="cpu")


def scheduled(loaded, params=None):
    engine = make_engine(loaded)
    ids = [engine.add_request(prompt, params or SamplingParams(max_tokens=3)) for prompt in PROMPTS]
    return engine, ids, engine.scheduler.schedule()


def test_run_returns_each_sampling_rows_token_and_the_phase_times(loaded):
    engine, _, batch = scheduled(loaded)
    result = engine.runner.run(batch)
    assert isinstance(result, StepResult)
    assert result.seqs == [item.seq for item in batch.items if item.samples] and len(result.seqs) == 2
    assert len(result.tokens) == 2 and result.failed == {} and result.logprobs == []
    assert result.kv_reads is None  # the torch backend counts no decode reads
    assert min(result.prepare_s, result.forward_s, result.sample_s) >= 0
    # run touches no request: nothing is committed until postprocess.
    assert all(item.seq.num_computed_tokens == 0 and not item.seq.output_token_ids for item in batch.items)
    engine.requests.postprocess(batch, result)
    run_to_end(engine)


def test_a_non_finite_row_is_zeroed_and_fails_alone(loaded):
    engine, ids, batch = scheduled(loaded)
    alone = make_engine(loaded)
    alone_id = alone.add_request(PROMPTS[1], SamplingParams(max_tokens=3))
    expected = alone.runner.run(alone.scheduler.schedule()).tokens[0]
    forward = engine.runner.forward

    def poisoned(*args):
        logits = forward(*args)
        with torch.inference_mode():
            logits[0] = float("nan")
        return logits

    engine.runner.forward = poisoned
    result = engine.runner.run(batch)
    assert list(result.failed) == [0] and isinstance(result.failed[0], FloatingPointError)
    assert result.tokens[1] == expected
    deltas = engine.requests.postprocess(batch, result)
    assert [delta.request_id for delta in deltas] == [ids[1]]
    assert [request_id for request_id, _ in engine.take_failed()] == [ids[0]] and ids[0] not in engine.requests
    assert engine.take_failed() == []
    del engine.runner.forward
    run_to_end(engine)
    alone.abort(alone_id)


def test_sample_batch_falls_back_row_by_row_and_fails_only_the_broken_row():
    class Fussy(Sampler):
        def sample(self, logits, seqs, masks=None):
            if any(seq.params.seed == 13 for seq in seqs):
                raise RuntimeError("this row cannot be sampled")
            return super().sample(logits, seqs, masks)

    from types import SimpleNamespace

    seqs = [SimpleNamespace(params=SamplingParams(seed=seed, logprobs=1), generator=None, index=0, seq_id=i) for i, seed in enumerate((1, 13, 2))]
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    tokens, logprobs, failed = Fussy().sample_batch(logits.clone(), seqs)
    assert list(failed) == [1] and str(failed[1]) == "this row cannot be sampled"
    assert tokens[0] == 1 and tokens[2] == 2
    assert logprobs[1] is None and logprobs[0].token_id == 1 and logprobs[2].token_id == 2
    tokens, logprobs, failed = Sampler().sample_batch(logits[[0, 2]].clone(), [seqs[0], seqs[2]])
    assert failed == {} and tokens == [1, 2]
