"""The prefill kernel (radixkv/cpu/csrc/paged_extend.c) inside the engine, in bf16 with
SmolLM2's attention shape (head_dim 64, 3 query heads per kv head): the first token's
logprobs, which prefill computes, are as close to the fp32 model as the torch reference
backend's bf16 ones, cold and over a cached prefix, and the kernel really ran. The tiny test model's head_dim 16 takes the kernel only in
fp32 (bf16 needs head_dim % 32 == 0), where test_exactness holds it to transformers."""

from __future__ import annotations

import pytest
import torch

from radixkv import SamplingParams
from radixkv.cpu import extend
from tests.helpers.engine import assert_pages_returned, make_llm
from tests.helpers.tiny_models import make_tiny_model

# Both bf16 backends are held to the same model in fp32 (the torch backend's): the kernel's
# first-token logprobs may be no further from it than the torch reference's own bf16 ones,
# give or take this much. A wrong mask or page would move them by whole units.
SLACK = 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-hd64"), "llama", hidden_size=192, num_attention_heads=3,
        num_key_value_heads=1, head_dim=64, intermediate_size=256,
    )  # fmt: skip


def first_token_logprobs(llm, prompts: list[list[int]]) -> list[dict[int, float]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, logprobs=5))
    return [dict(o.outputs[0].logprobs[0].top) for o in outputs]


def test_bf16_prefill_is_as_close_to_fp32_as_the_torch_backend_cold_and_over_a_cached_prefix(model_dir, monkeypatch):
    if not extend.fits(torch.bfloat16, 64, 3):
        pytest.skip("the bf16 prefill kernel needs avx512_bf16, which this CPU lacks")
    calls = []
    kernel = extend.paged_extend
    monkeypatch.setattr(extend, "paged_extend", lambda *args: calls.append(args[6].tolist()) or kernel(*args))
    shared = [(7 * i + 3) % 300 + 10 for i in range(300)]  # crosses the kernel's 256-key chunks
    prompts = [shared + [11, 12, 13], shared + [21, 22, 23, 24, 25]]
    results = {}
    for backend, dtype in (("cpu", "bfloat16"), ("torch", "bfloat16"), ("torch", "float32")):
        llm = make_llm(model_dir, dtype=dtype, attention_backend=backend, page_size=16)
        cold = first_token_logprobs(llm, [shared])
        warm = first_token_logprobs(llm, prompts)  # their suffixes over the cached 288 tokens
        results[backend, dtype] = cold + warm
        assert all(o.num_cached_tokens >= 288 for o in llm.generate(prompts, SamplingParams(max_tokens=1)))
        assert_pages_returned(llm.engine)
    assert calls and any(max(q_lens) < 300 for q_lens in calls), "the kernel did not run a suffix over a cached prefix"
    errors = {}
    for backend in ("cpu", "torch"):
        errors[backend] = max(
            abs(got[token] - truth[token])
            for got, truth in zip(results[backend, "bfloat16"], results["torch", "float32"], strict=True)
            for token in got.keys() & truth.keys()
        )
        for got, truth in zip(results[backend, "bfloat16"], results["torch", "float32"], strict=True):
            assert max(got, key=got.get) == max(truth, key=truth.get), backend
    assert errors["cpu"] <= errors["torch"] + SLACK, errors
