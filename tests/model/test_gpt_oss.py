"""gpt-oss at test size: greedy tokens equal transformers' generate (fp32) on prompts several times
its 8-token window, with attention sinks, biases, YaRN RoPE and its clamped-SwiGLU experts, on the
torch and cpu backends (its sink layers on the native kernels), the prefix cache on and off, warm,
chunked and preempted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from radixkv import SamplingParams
from radixkv.attention import torch_backend
from radixkv.attention.torch_backend import attend_with_sinks
from radixkv.cpu import native
from radixkv.errors import UnsupportedModel
from tests.helpers.engine import assert_pages_returned, hf_greedy, make_llm, shared_prefix_prompts
from tests.helpers.tiny_models import init_gpt_oss_param, save_random_model

MAX_NEW = 12
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(native.load() is None, reason="no native library here"))]


def make_gpt_oss(path: Path, seed: int = 1, **overrides) -> Path:
    return save_random_model(path, "gpt_oss", seed, init_gpt_oss_param, **overrides)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"))


@pytest.fixture(scope="module")
def reference(tiny_gpt_oss):
    prompts = shared_prefix_prompts(5)
    assert min(len(p) for p in prompts) > 2 * 8, "every prompt outgrows the window twice"
    return prompts, hf_greedy(tiny_gpt_oss, prompts, MAX_NEW)


def test_sinks_match_transformers_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    sinks = torch.randn(4) * 2
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    module = type("M", (), {"num_key_value_groups": 2, "sinks": sinks, "training": False})()
    additive = torch.zeros(1, 1, 5, 9).masked_fill(~mask, float("-inf"))
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    ours = attend_with_sinks(q, k, v, mask[None, None], 0.25, sinks)
    torch.testing.assert_close(ours.transpose(1, 2), expected, rtol=0, atol=0)


def test_sinks_and_windows_matter(tiny_gpt_oss, reference, tmp_path):
    """The same weights without sinks, or with a window past every prompt, answer otherwise: the
    tests below would catch a backend that ignored either."""
    from transformers import AutoConfig, AutoModelForCausalLM

    prompts, expected = reference
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    model.save_pretrained(tmp_path / "no-sinks")
    assert hf_greedy(tmp_path / "no-sinks", prompts, MAX_NEW) != expected
    config = AutoConfig.from_pretrained(tiny_gpt_oss)
    config.sliding_window = 512
    AutoModelForCausalLM.from_pretrained(tiny_gpt_oss, config=config).save_pretrained(tmp_path / "wide")
    assert hf_greedy(tmp_path / "wide", prompts, MAX_NEW) != expected


@pytest.fixture
def kernels_only(monkeypatch):
    """The cpu backend's sink layers run on its kernels: the torch reference's sink attention
    raises if called (a kernel that dropped the sinks then answers otherwise:
    test_sinks_and_windows_matter)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a sink layer took the torch reference")

    monkeypatch.setattr(torch_backend, "reference_sinks", refuse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_gpt_oss_matches_transformers(tiny_gpt_oss, reference, backend, cache, request):
    if backend == "cpu":
        request.getfixturevalue("kernels_only")
    prompts, expected = reference
    llm = make_llm(tiny_gpt_oss, attention_backend=backend, enable_prefix_caching=cache)
    assert llm.engine.windows is not None, "window layers keep their own pages"
    params = SamplingParams(max_tokens=MAX_NEW)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    warm = llm.generate(prompts, params)
    assert [o.token_ids for o in warm] == expected
    if cache:
        assert all(o.num_cached_tokens > 8 for o in warm), "warm prompts hit more than a window"
    assert_pages_returned(llm.engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_chunked_and_preempted(tiny_gpt_oss, reference, backend, request):
    if backend == "cpu":
        request.getfixturevalue("kernels_only")
    prompts, expected = reference
    chunked = make_llm(tiny_gpt_oss, attention_backend=backend, max_batch_tokens=7)
    assert [o.token_ids for o in chunked.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected
    llm = make_llm(tiny_gpt_oss, attention_backend=backend, num_pages=22)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected
    assert llm.stats().num_preemptions > 0
    assert_pages_returned(llm.engine)


def test_gpt_oss_batch_invariant_matches_transformers(tiny_gpt_oss, reference, request):
    if native.load():
        request.getfixturevalue("kernels_only")
    prompts, expected = reference
    llm = make_llm(tiny_gpt_oss, attention_backend="cpu" if native.load() else "torch", batch_invariant=True)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))] == expected


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_refuses_sinks_by_name(tiny_gpt_oss):
    with pytest.raises(UnsupportedModel, match="attention sinks.*'triton'"):
        make_llm(tiny_gpt_oss, attention_backend="triton")
