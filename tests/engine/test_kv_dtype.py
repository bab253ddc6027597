"""EngineConfig.kv_dtype end to end: greedy output with the cache equals greedy output without it,
bit for bit, within each kv_dtype, on the torch reference and the CPU kernels; pages are sized in
the storage dtype's bytes; an fp8 request on a CPU fails naming why."""

from __future__ import annotations

import pytest
import torch

from radixkv import SamplingParams
from radixkv.errors import ConfigError
from tests.helpers.engine import TEST_DEVICE, assert_pages_returned, make_llm, shared_prefix_prompts

MAX_NEW = 10
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU backend runs on CPU only")


@cpu_only
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_cache_on_and_off_agree_bit_for_bit_within_a_kv_dtype(tiny_llama, backend, kv_dtype, batch_invariant):
    """Greedy tokens always; with batch_invariant every row's logits too (its logprobs)."""
    prompts = shared_prefix_prompts(3)
    params = SamplingParams(max_tokens=MAX_NEW, logprobs=0 if batch_invariant else None)
    options = dict(kv_dtype=kv_dtype, attention_backend=backend, batch_invariant=batch_invariant)
    cached = make_llm(tiny_llama, **options)
    assert cached.engine.pool.k_cache[0].dtype == {"bf16": torch.bfloat16, "int8": torch.int8}[kv_dtype]
    cold = cached.generate(prompts, params)
    warm = cached.generate(prompts, params)
    assert all(o.num_cached_tokens >= 20 for o in warm)
    plain = make_llm(tiny_llama, enable_prefix_caching=False, **options)
    uncached = plain.generate(prompts, params)
    want = [_result(o, batch_invariant) for o in uncached]
    assert [_result(o, batch_invariant) for o in cold] == want
    assert [_result(o, batch_invariant) for o in warm] == want
    assert_pages_returned(cached.engine)


@cpu_only
def test_bf16_compute_over_int8_pages_agrees_with_and_without_the_cache(tiny_llama):
    prompts = shared_prefix_prompts(4)
    params = SamplingParams(max_tokens=MAX_NEW)
    options = dict(kv_dtype="int8", attention_backend="cpu", dtype="bfloat16")
    cached = make_llm(tiny_llama, **options)
    cold, warm = cached.generate(prompts, params), cached.generate(prompts, params)
    assert all(o.num_cached_tokens >= 20 for o in warm)
    uncached = make_llm(tiny_llama, enable_prefix_caching=False, **options).generate(prompts, params)
    assert [o.token_ids for o in cold] == [o.token_ids for o in warm] == [o.token_ids for o in uncached]


def _result(output, logprobs: bool) -> tuple[list[int], list[float]]:
    return output.token_ids, [lp.logprob for lp in output.outputs[0].logprobs] if logprobs else []


@cpu_only
def test_int8_pages_hold_about_twice_the_tokens_of_bf16_pages_per_byte(tiny_llama):
    sizes = {}
    for kv_dtype in ("bf16", "int8", "fp32"):
        llm = make_llm(tiny_llama, kv_dtype=kv_dtype)
        sizes[kv_dtype] = llm.engine.pool.page_nbytes
    head_dim = make_llm(tiny_llama).engine.model_config.head_dim
    assert sizes["fp32"] == 2 * sizes["bf16"]
    # int8 elements and one fp16 scale per head_dim of them.
    assert sizes["bf16"] / sizes["int8"] == pytest.approx(2 * head_dim / (head_dim + 2))


def test_fp8_needs_a_cuda_gpu_with_e4m3(tiny_llama):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has e4m3: fp8 pages are allowed here")
    with pytest.raises(ConfigError) as error:
        make_llm(tiny_llama, kv_dtype="fp8", device="cpu")
    assert error.value.param == "kv_dtype"


def test_kv_dtype_is_validated():
    from radixkv.config import EngineConfig

    with pytest.raises(ConfigError) as error:
        EngineConfig(kv_dtype="int4")
    assert error.value.param == "kv_dtype"
