"""Greedy tokens from LLM.generate equal transformers' generate, cache or no cache."""

from __future__ import annotations

import pytest

from radixkv import LLM, SamplingParams
from tests.helpers.engine import assert_pages_returned, hf_greedy, make_llm, shared_prefix_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    prompts = shared_prefix_prompts(0)
    return prompts, hf_greedy(tiny_llama, prompts, MAX_NEW)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_cold_and_warm_cache_match_transformers(tiny_llama, llama_reference, policy):
    prompts, expected = llama_reference
    llm = make_llm(tiny_llama, policy=policy)
    params = SamplingParams(max_tokens=MAX_NEW)
    cold = llm.generate(prompts, params)
    assert [o.token_ids for o in cold] == expected
    if policy == "lpm":
        # In-step deferral: later prompts of a group wait a step and reuse the first one's
        # prefix. FCFS admits them all at once, so they compute it side by side.
        assert sum(o.num_cached_tokens for o in cold) > 0
    warm = llm.generate(prompts, params)
    assert [o.token_ids for o in warm] == expected
    for output in warm:
        assert output.num_cached_tokens >= 20  # at least the group's shared full blocks
        assert output.num_cached_tokens <= output.num_prompt_tokens - 1
    assert_pages_returned(llm.engine)


def test_cache_disabled_matches_transformers(tiny_llama, llama_reference):
    prompts, expected = llama_reference
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert [o.token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens == 0 for o in outputs)
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_chunked_prefill_matches_transformers(tiny_llama, llama_reference):
    prompts, expected = llama_reference
    llm = make_llm(tiny_llama, max_batch_tokens=7)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert [o.token_ids for o in outputs] == expected
    assert_pages_returned(llm.engine)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_eviction_and_preemption_keep_outputs_exact(tiny_llama, llama_reference, policy):
    prompts, expected = llama_reference
    # 22 pages of 4 tokens: one request (<= 51 prompt + 12 new tokens) fits, six do not.
    llm = make_llm(tiny_llama, num_pages=22, policy=policy)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.cache.evicted_pages > 0
    assert_pages_returned(llm.engine)


def test_qwen2_with_qkv_bias_matches_transformers(tiny_qwen2):
    prompts = shared_prefix_prompts(1)
    expected = hf_greedy(tiny_qwen2, prompts, MAX_NEW)
    llm = make_llm(tiny_qwen2)
    params = SamplingParams(max_tokens=MAX_NEW)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert_pages_returned(llm.engine)


def test_generated_blocks_are_cached_for_the_next_turn(tiny_llama):
    llm = make_llm(tiny_llama)
    prompt = shared_prefix_prompts(2)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=16))[0]
    second_turn = prompt + first.token_ids + [5, 6, 7]
    second = llm.generate([second_turn], SamplingParams(max_tokens=4))[0]
    # Everything up to the last full block of prompt + reply was computed in turn one.
    assert second.num_cached_tokens == ((len(prompt) + len(first.token_ids) - 1) // 4) * 4
    assert second.token_ids == hf_greedy(llm.config.model, [second_turn], 4)[0]
    assert_pages_returned(llm.engine)


def test_real_smollm2_matches_transformers_cold_and_warm():
    from radixkv.model.loader import ModelNotFound, default_model_gguf, resolve_model_folder

    try:
        default_model_gguf()
    except ModelNotFound as missing:
        pytest.skip(str(missing))

    llm = LLM(None, dtype="float32", device="cpu", num_pages=256, check_invariants=True, seed=0, weight_dtype="float")
    system = {"role": "system", "content": "You are a concise assistant for a bicycle shop. " * 6}
    conversations = [[system, {"role": "user", "content": q}] for q in ("Do you sell helmets?", "When do you open?")]
    prompts = [llm.encode_chat(c) for c in conversations]
    expected = hf_greedy(resolve_model_folder(None), prompts, 10)
    params = SamplingParams(max_tokens=10)
    cold = llm.generate(prompts, params)
    warm = llm.generate(prompts, params)
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert all(o.num_cached_tokens >= 64 for o in warm)
    assert_pages_returned(llm.engine)


def test_without_native_kernels_the_torch_paths_match_transformers(tiny_llama, llama_reference):
    # As on a machine without a C compiler: the torch reference backend, torch layer glue.
    prompts, expected = llama_reference
    llm = make_llm(tiny_llama, native_kernels=False)
    assert llm.engine.loaded.model.attention.name == "torch"
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected
    assert_pages_returned(llm.engine)
