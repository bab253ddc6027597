"""End to end: the engine on the Triton backend (compiled on a GPU, interpreted on CPU) gives the
torch backend's greedy tokens, with cached prefixes, chunked prefill and decode all going
through the kernels."""

from __future__ import annotations

import pytest
import torch

from radixkv import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model

# Both backends run on the same device, so only the attention differs. bf16 only on a GPU: the
# interpreter computes bf16 wrongly.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = ["float32", "float16"] + (["bfloat16"] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_matches_torch_backend(tmp_path, dtype):
    model_dir = make_tiny_model(tmp_path / "tiny", "llama", seed=3)
    shared = [(11 * i) % 300 + 1 for i in range(21)]
    prompts = [shared + [7, 8, 9], shared + [40], [5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=6)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(model_dir),
            dtype=dtype,
            device=DEVICE,
            attention_backend=backend,
            page_size=4,
            num_pages=64,
            max_batch_tokens=16,  # chunked prefill: extend over a paged prefix within one request
            check_invariants=True,
        )
        first = llm.generate(prompts, params)
        second = llm.generate(prompts, params)  # warm: prefixes come from cached pages
        assert [o.token_ids for o in first] == [o.token_ids for o in second]
        assert sum(o.num_cached_tokens for o in second) > 0
        outputs[backend] = [o.token_ids for o in first]
    assert outputs["triton"] == outputs["torch"]


def test_triton_cascade_decode_matches_torch_backend(tmp_path):
    # Three requests over one 80-token cached prefix (20 pages of 4): decode runs them as a
    # cascade group (shared keys read once, merged with each one's own), and the greedy
    # tokens equal the torch backend's; the engine counts the reads the group saved.
    model_dir = make_tiny_model(tmp_path / "tiny", "llama", seed=4)
    shared = [(13 * i) % 300 + 1 for i in range(80)]
    prompts = [shared + [7, 8, 9], shared + [40], shared + [5, 6]]
    params = SamplingParams(max_tokens=5)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), dtype="float32", device=DEVICE, attention_backend=backend, page_size=4, num_pages=96,
                  check_invariants=True)  # fmt: skip
        llm.generate([shared], SamplingParams(max_tokens=1))  # the prefix cached first
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        if backend == "triton":
            assert llm.engine.counters.num_kv_tokens_read_shared > 0
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton row ops run on CUDA tensors only (no GPU here)")
def test_triton_row_ops_keep_the_greedy_tokens_of_the_torch_ops(tmp_path):
    # On CUDA, native_kernels=True runs the residual add + RMSNorm, rope and SiLU * up as one
    # Triton kernel each; False keeps torch's ops. In fp32 they differ in the last bit at most.
    model_dir = make_tiny_model(tmp_path / "tiny", "llama", seed=5)
    shared = [(17 * i) % 300 + 1 for i in range(40)]
    prompts = [shared + [7, 8, 9], shared + [40], [5, 6, 7, 8, 9, 10]]
    outputs = {}
    for native in (True, False):
        llm = LLM(str(model_dir), dtype="float32", device=DEVICE, page_size=4, num_pages=96, native_kernels=native)
        outputs[native] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
    assert outputs[True] == outputs[False]


def test_triton_backend_over_int8_pages_matches_torch_backend(tmp_path):
    """kv_dtype="int8" on the Triton backend: its store quantizes to the reference's bytes and
    its kernels read them with their scales, so the greedy tokens are the torch backend's over
    int8 pages, cold and warm (cached prefixes read from int8 pages)."""
    model_dir = make_tiny_model(tmp_path / "tiny", "llama", seed=5)
    shared = [(17 * i) % 300 + 1 for i in range(21)]
    prompts = [shared + [7, 8, 9], shared + [40], [5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=6)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), dtype="float32", device=DEVICE, attention_backend=backend, kv_dtype="int8", page_size=4,
                  num_pages=64, max_batch_tokens=16, check_invariants=True)  # fmt: skip
        assert llm.engine.pool.k_cache[0].dtype == torch.int8
        first = llm.generate(prompts, params)
        second = llm.generate(prompts, params)
        assert [o.token_ids for o in first] == [o.token_ids for o in second]
        assert sum(o.num_cached_tokens for o in second) > 0
        outputs[backend] = [o.token_ids for o in first]
    assert outputs["triton"] == outputs["torch"]
