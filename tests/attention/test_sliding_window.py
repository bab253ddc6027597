"""Sliding windows in every attention backend: a query at position p attends to keys
p - W + 1 .. p only (W counts the query itself, as transformers and llama.cpp count it), in
extend (prefill chunks over a cached prefix, across the CPU kernel's 64-query blocks and
256-key chunks) and in paged decode, held to a float64 reference that gathers only the window.
The Triton kernels run under TRITON_INTERPRET=1 (fp32, small shapes) where Triton is installed.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from tests.helpers.paged import assert_close, gen, make_meta, make_paged, make_q, prepared, with_sinks  # noqa: F401  (gen is a fixture)

from radixkv.attention.torch_backend import TorchBackend
from radixkv.cpu import extend
from radixkv.cpu import native as native_library
from radixkv.cpu.features import cpu_features

WINDOWS = [1, 5, 64, 300]


def windowed_reference(q, paged, meta, scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every query row of the step over the keys of its window (None: every key), in float64;
    sinks: each head's logit in its softmax (gpt-oss)."""
    num_q_heads = q.shape[1]
    num_kv_heads, head_dim = paged.k_cache.shape[2:]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = meta.cu_q_lens.tolist()
    for b, (q_len, seq_len) in enumerate(zip(meta.q_lens_list, meta.seq_lens_list)):
        pages = paged.page_table[b, : math.ceil(seq_len / paged.page_size)].long()
        keys = paged.k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].double().repeat_interleave(group, 1)
        values = paged.v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].double().repeat_interleave(group, 1)
        for t in range(q_len):
            position, row = seq_len - q_len + t, starts[b] + t
            first = 0 if window is None else max(0, position - window + 1)
            scores = torch.einsum("hd,thd->ht", q[row].double(), keys[first : position + 1]) * scale
            probs = with_sinks(scores, sinks).softmax(-1)[:, : position + 1 - first]
            out[row] = torch.einsum("ht,thd->hd", probs, values[first : position + 1])
    return out


def backends(dtype: torch.dtype) -> list:
    found = [TorchBackend()]
    if native_library.load() is not None:
        from radixkv.attention.cpu_backend import CPUBackend

        found.append(CPUBackend())
    if dtype == torch.float32 and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        from radixkv.attention.triton_backend import TritonBackend

        found.append(TritonBackend())
    return found


def stored_step(gen, prefix_lens: list[int], q_lens: list[int], head_dim: int, dtype: torch.dtype):
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    num_q_heads, num_kv_heads = 4, 2
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 7, dtype)
    q = make_q(gen, sum(q_lens), num_q_heads, num_kv_heads, head_dim, dtype)
    slots = make_meta(paged, prefix_lens, q_lens).slot_mapping
    k = paged.k_cache.view(-1, num_kv_heads, head_dim)[slots]
    v = paged.v_cache.view(-1, num_kv_heads, head_dim)[slots]
    return paged, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", WINDOWS)
def test_extend_with_a_window_matches_the_reference(gen, window, dtype) -> None:
    """A mixed step: prefill chunks (one of 150 tokens over a 300-token prefix: three of the
    CPU kernel's query blocks and more than one key chunk) beside one-token requests."""
    prefix_lens, q_lens = [300, 0, 40, 7, 600], [150, 20, 1, 9, 1]
    paged, q, k, v = stored_step(gen, prefix_lens, q_lens, 32, dtype)
    scale = 32**-0.5
    for backend in backends(dtype):
        meta = prepared(backend, make_meta(paged, prefix_lens, q_lens), paged.k_cache, q.shape[1])
        out = backend.extend(q, k, v, paged.k_cache, paged.v_cache, meta, scale, window=window)
        ref = windowed_reference(q, paged, meta, scale, window)
        assert_close(out, ref, dtype, f"{backend.name} extend, window {window}, seed {gen.initial_seed()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_with_a_window_matches_the_reference(gen, window, dtype) -> None:
    prefix_lens = [0, 4, 63, 299, 700]
    q_lens = [1] * len(prefix_lens)
    paged, q, k, v = stored_step(gen, prefix_lens, q_lens, 32, dtype)
    scale = 32**-0.5
    for backend in backends(dtype):
        meta = prepared(backend, make_meta(paged, prefix_lens, q_lens), paged.k_cache, q.shape[1])
        out = backend.decode(q, paged.k_cache, paged.v_cache, meta, scale, window=window)
        ref = windowed_reference(q, paged, meta, scale, window)
        assert_close(out, ref, dtype, f"{backend.name} decode, window {window}, seed {gen.initial_seed()}")


@pytest.mark.parametrize("window", [5, 300])
def test_batch_invariant_rows_with_a_window_match_the_reference(gen, window) -> None:
    prefix_lens, q_lens = [300, 0, 40], [70, 20, 1]
    paged, q, k, v = stored_step(gen, prefix_lens, q_lens, 32, torch.float32)
    for backend in backends(torch.float32)[:2]:  # the backends that run batch-invariant steps
        meta = make_meta(paged, prefix_lens, q_lens)
        meta.batch_invariant = True
        meta = prepared(backend, meta, paged.k_cache, q.shape[1])
        out = backend.extend(q, k, v, paged.k_cache, paged.v_cache, meta, 0.2, window=window)
        assert_close(out, windowed_reference(q, paged, meta, 0.2, window), torch.float32, f"{backend.name}, window {window}")


SINK_STEPS = {
    "mixed": ([300, 0, 40, 7, 600], [150, 20, 1, 9, 1]),  # prefill chunks beside one-token requests
    "decode": ([0, 4, 299, 700], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 5, 300])
@pytest.mark.parametrize("invariant", [False, True], ids=["batched", "batch-invariant"])
@pytest.mark.parametrize("step", list(SINK_STEPS))
def test_sinks_with_and_without_a_window_match_the_reference(gen, step, window, dtype, invariant) -> None:
    """gpt-oss's sink logits (one per query head, about the scores' size) in extend, the one-token
    requests beside it and decode; dropping them moves the output far past the tolerance."""
    prefix_lens, q_lens = SINK_STEPS[step]
    # The torch reference's bf16 softmax (transformers' eager attention, in bf16) is looser than
    # the kernels' fp32 one, so bf16 holds the kernels only. A batched bf16 prefill chunk runs
    # the prefill kernel, which needs AVX512_BF16; elsewhere the cpu backend takes the reference.
    if dtype == torch.bfloat16 and step == "mixed" and not invariant and not extend.fits(dtype, 32, 2):
        pytest.skip(f"the bf16 prefill kernel needs {cpu_features().missing_bf16 or 'AVX-512'}, which this CPU lacks")
    sinks = torch.randn(4, generator=gen) * 3
    scale = 32**-0.5
    paged, q, k, v = stored_step(gen, prefix_lens, q_lens, 32, dtype)
    for backend in backends(dtype)[:2] if dtype == torch.float32 else backends(dtype)[1:2]:
        meta = make_meta(paged, prefix_lens, q_lens)
        meta.batch_invariant = invariant
        meta = prepared(backend, meta, paged.k_cache, q.shape[1])
        out = backend.forward(q, k, v, paged.k_cache, paged.v_cache, meta, scale, window=window, sinks=sinks)
        what = f"{backend.name}, q_lens {q_lens}, window {window}, seed {gen.initial_seed()}"
        assert_close(out, windowed_reference(q, paged, meta, scale, window, sinks), dtype, what)
        assert (out.double() - windowed_reference(q, paged, meta, scale, window)).abs().max() > 0.1, what
