"""Gemma 3 end to end: greedy tokens equal transformers' generate for a tiny random Gemma 3 (fp32)
whose prompts are several times its 8-token window, on every attention backend, with the prefix
cache on and off, cold and warm, chunked, evicted and preempted."""

from __future__ import annotations

import importlib.util

import pytest

from radixkv import SamplingParams
from radixkv.cpu import native
from tests.helpers.engine import assert_pages_returned, hf_greedy, make_llm, shared_prefix_prompts

MAX_NEW = 12


def _backends() -> list:
    found = ["torch"]
    found.append(pytest.param("cpu", marks=pytest.mark.skipif(native.load() is None, reason="no native library here")))
    # Triton on the CPU runs under TRITON_INTERPRET=1, which tests/conftest.py sets.
    triton = importlib.util.find_spec("triton") is not None
    found.append(pytest.param("triton", marks=pytest.mark.skipif(not triton, reason="triton is not installed")))
    return found


@pytest.fixture(scope="module")
def gemma_reference(tiny_gemma3):
    prompts = shared_prefix_prompts(5)
    assert min(len(p) for p in prompts) > 2 * 8, "every prompt outgrows the window twice"
    return prompts, hf_greedy(tiny_gemma3, prompts, MAX_NEW)


def test_windows_matter_for_these_prompts(tiny_gemma3, gemma_reference, tmp_path):
    """The same weights with a window past every prompt answer otherwise: the tests below
    would catch a backend that ignored the window."""
    from transformers import AutoConfig, AutoModelForCausalLM

    prompts, expected = gemma_reference
    config = AutoConfig.from_pretrained(tiny_gemma3)
    config.sliding_window = 512
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3, config=config)
    model.save_pretrained(tmp_path)
    assert hf_greedy(tmp_path, prompts, MAX_NEW) != expected


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_gemma3_matches_transformers(tiny_gemma3, gemma_reference, backend, cache):
    prompts, expected = gemma_reference
    llm = make_llm(tiny_gemma3, attention_backend=backend, enable_prefix_caching=cache)
    params = SamplingParams(max_tokens=MAX_NEW)
    cold = llm.generate(prompts, params)
    assert [o.token_ids for o in cold] == expected
    warm = llm.generate(prompts, params)
    assert [o.token_ids for o in warm] == expected
    if cache:
        assert all(o.num_cached_tokens > 8 for o in warm), "warm prompts hit more than a window"
    assert_pages_returned(llm.engine)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(native.load() is None, reason="no native library"))])
def test_gemma3_chunked_evicted_and_preempted(tiny_gemma3, gemma_reference, backend):
    prompts, expected = gemma_reference
    chunked = make_llm(tiny_gemma3, attention_backend=backend, max_batch_tokens=7)
    assert [o.token_ids for o in chunked.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected
    llm = make_llm(tiny_gemma3, attention_backend=backend, num_pages=22)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected
    assert llm.stats().num_preemptions > 0
    assert_pages_returned(llm.engine)


def test_gemma3_batch_invariant_matches_transformers(tiny_gemma3, gemma_reference):
    prompts, expected = gemma_reference
    llm = make_llm(tiny_gemma3, attention_backend="cpu" if native.load() else "torch", batch_invariant=True)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected


@pytest.mark.parametrize("backend", _backends())
def test_gemma3_window_pages_small_pool(tiny_gemma3, gemma_reference, backend):
    """Layer groups: the window layers' pool holds a few windows, not the prompts. Blocks
    behind a window go back while a request runs, finished prefixes lose window pages under
    pressure, and a warm match stops where a window lacks them; tokens stay transformers'."""
    prompts, expected = gemma_reference
    llm = make_llm(tiny_gemma3, attention_backend=backend, max_batch_tokens=16, num_window_pages=10)
    windows = llm.engine.windows
    assert windows is not None and windows.pool.num_pages == 10
    assert windows.pool.num_pages * 4 < sum(len(p) for p in prompts), "the window pool cannot hold every prompt"
    params = SamplingParams(max_tokens=MAX_NEW)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    one = max(prompts, key=len)
    assert llm.generate([one], params)[0].token_ids == expected[prompts.index(one)]
    warm = llm.generate([one], params)[0]
    assert warm.token_ids == expected[prompts.index(one)] and warm.num_cached_tokens > 8, "a warm hit past the window"
    assert_pages_returned(llm.engine)


def test_gemma3_groups_refuse_what_they_cannot_hold(tiny_gemma3):
    from radixkv.errors import ConfigError

    with pytest.raises(ConfigError) as small:
        make_llm(tiny_gemma3, max_batch_tokens=16, num_window_pages=4)
    assert small.value.param == "num_window_pages" and "at least 7" in str(small.value)


def test_gemma3_kv_bytes_in_use_keep_the_window_only(tiny_gemma3, gemma_reference):
    """One long sequence: the full layer keeps every token, the window layers a window and the
    chunk being written; stats().cache.kv_bytes_in_use counts both pools."""
    prompts, _ = gemma_reference
    prompt = max(prompts, key=len)
    llm = make_llm(tiny_gemma3, max_batch_tokens=16, enable_prefix_caching=False)
    engine, windows = llm.engine, llm.engine.windows
    engine.add_request(prompt, SamplingParams(max_tokens=MAX_NEW))
    full_bytes, window_bytes = engine.pool.page_nbytes, windows.pool.page_nbytes
    assert window_bytes == 3 * full_bytes, "three window layers beside one full layer"
    peak_window_pages = 0
    while engine.has_unfinished():
        engine.step()
        if not engine.has_unfinished():
            break
        seq = engine.scheduler.running[0]
        held_window = sum(1 for page in seq.window_table if page >= 0)
        assert held_window <= -(-(8 - 1) // 4) + 1, "between steps a sequence holds its window and the page being written"
        peak_window_pages = max(peak_window_pages, windows.pool.num_pages - windows.pool.num_free)
        in_use = llm.stats().cache.kv_bytes_in_use
        assert in_use == len(seq.page_table) * full_bytes + held_window * window_bytes
    # Every layer keeping every token would hold 4 layers x all pages; the window layers held 3.
    assert peak_window_pages <= 3 < -(-(len(prompt) + MAX_NEW) // 4)
    assert llm.stats().cache.kv_bytes_in_use == 0


@pytest.mark.skipif(native.load() is None, reason="no native library here")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "layer-loop"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_gemma3_fused_decode_matches_transformers(tiny_gemma3, gemma_reference, monkeypatch, fused, cache):
    """The fused native decode step (radixkv.cpu.fused_decode) over layer groups: window layers
    read their own pool's tables, cold and warm; switched off (model.layers.fused = None) the
    layer loop gives the same tokens, both transformers'."""
    from radixkv.model.fused_layers import fused_decode

    prompts, expected = gemma_reference
    llm = make_llm(tiny_gemma3, attention_backend="cpu", enable_prefix_caching=cache, max_batch_tokens=16, num_window_pages=16)
    model = llm.engine.loaded.model
    step = fused_decode(model)
    assert step is not None, "Gemma 3 takes the fused decode step"
    assert llm.engine.windows is not None, "its window layers keep their own pages"
    calls = []
    run = step.run
    monkeypatch.setattr(step, "run", lambda *args: calls.append(args[8] is not None) or run(*args))  # args[8]: window tables
    model.layers.fused = step if fused else None
    params = SamplingParams(max_tokens=MAX_NEW)
    for _ in range(2):  # cold, then warm
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert calls and all(calls) if fused else not calls
    assert_pages_returned(llm.engine)
