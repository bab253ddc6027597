"""The CPU backend (radixkv/attention/cpu_backend.py) over the native kernels, held to the
pure-torch TorchBackend and to the float64 reference of tests/helpers/paged.py; tolerances there.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.paged import Paged, assert_close, gen, make_meta, make_paged, make_q, prepared, reference  # noqa: F401  (gen is a fixture)

from radixkv.attention import make_backend
from radixkv.attention.cpu_backend import CPUBackend
from radixkv.attention.torch_backend import TorchBackend
from radixkv.config import EngineConfig
from radixkv.cpu import decode as native
from radixkv.cpu import extend
from radixkv.cpu import native as native_library
from radixkv.errors import ConfigError

if native_library.load() is None:
    pytest.skip(
        "native paged-decode kernel unavailable (no C compiler, or its build failed)",
        allow_module_level=True,
    )

DTYPES = [torch.float32, torch.bfloat16]

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpu_backend_decode_matches_the_torch_reference(gen, head_dim, dtype) -> None:
    seq_lens = [1, 40, 600, 256, 17]
    num_q_heads, num_kv_heads = 8, 2
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 7, dtype)
    q = make_q(gen, len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    results = {}
    for backend in (CPUBackend(), TorchBackend()):
        meta = prepared(backend, make_meta(paged, [s - 1 for s in seq_lens], [1] * len(seq_lens)), paged.k_cache, num_q_heads)
        results[backend.name] = backend.decode(q, paged.k_cache, paged.v_cache, meta, scale)
        if backend.name == "cpu":
            assert meta.backend_state.kernel, "the CPU backend did not take the kernel"
    what = f"seed {gen.initial_seed()}"
    out, torch_out = results["cpu"], results["torch"]
    assert out.shape == torch_out.shape == q.shape
    assert_close(out, torch_out.double(), dtype, f"cpu vs torch reference, {what}")
    assert_close(out, reference(q, paged, scale), dtype, f"cpu vs float64 reference, {what}")


def mixed_batch(gen, head_dim: int, dtype: torch.dtype):
    """A mixed step: one-token requests beside prefill chunks, the step's own K/V stored already."""
    prefix_lens = [40, 0, 300, 23, 255, 0, 600]
    q_lens = [1, 9, 1, 5, 1, 1, 30]
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    num_q_heads, num_kv_heads = 6, 2
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 7, dtype)
    q = make_q(gen, sum(q_lens), num_q_heads, num_kv_heads, head_dim, dtype)
    slots = make_meta(paged, prefix_lens, q_lens).slot_mapping
    # The step's own K/V, as stored in the cache (extend reads everything from the cache).
    k = paged.k_cache.view(-1, num_kv_heads, head_dim)[slots]
    v = paged.v_cache.view(-1, num_kv_heads, head_dim)[slots]
    return paged, q, k, v, prefix_lens, q_lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpu_backend_extend_mixed_batch_matches_the_torch_reference(gen, head_dim, dtype) -> None:
    """One-token requests of a mixed batch go through the decode kernel (rows=); the rest through
    the prefill kernel where it takes the shapes (tests/cpu/test_extend.py tests it), else through the
    reference's gather + SDPA code."""
    paged, q, k, v, prefix_lens, q_lens = mixed_batch(gen, head_dim, dtype)
    scale = head_dim**-0.5
    results = {}
    for backend in (CPUBackend(), TorchBackend()):
        meta = prepared(backend, make_meta(paged, prefix_lens, q_lens), paged.k_cache, q.shape[1])
        results[backend.name] = backend.extend(q, k, v, paged.k_cache, paged.v_cache, meta, scale)
        if backend.name == "cpu":
            assert meta.backend_state.decode_rows is not None, "the one-token requests did not take the kernel"
    out, torch_out = results["cpu"], results["torch"]
    what = f"seed {gen.initial_seed()}"
    starts = meta.cu_q_lens.tolist()
    decode_requests = [b for b, n in enumerate(q_lens) if n == 1]
    decode_rows = [starts[b] for b in decode_requests]
    prefill_rows = [r for b, n in enumerate(q_lens) if n > 1 for r in range(starts[b], starts[b] + n)]
    if extend.fits(dtype, head_dim, q.shape[1] // paged.k_cache.shape[2]):
        assert_close(out[prefill_rows], torch_out[prefill_rows].double(), dtype, f"prefill kernel vs torch reference, {what}")
    else:  # multi-token requests run the reference's own code in the CPU backend
        assert torch.equal(out[prefill_rows], torch_out[prefill_rows])
    assert_close(out[decode_rows], torch_out[decode_rows].double(), dtype, f"cpu vs torch reference, {what}")
    decode_paged = Paged(
        paged.k_cache, paged.v_cache, paged.page_table[decode_requests], paged.seq_lens[decode_requests], 7
    )
    ref = reference(q, decode_paged, scale, rows=decode_rows)
    assert_close(out[decode_rows], ref, dtype, f"cpu vs float64 reference, {what}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_backend_batch_invariant_rows_match_the_torch_reference(gen, dtype) -> None:
    """batch_invariant: every row of a mixed step through the kernel as its own request, held
    to the reference's row-by-row SDPA."""
    paged, q, k, v, prefix_lens, q_lens = mixed_batch(gen, 64, dtype)
    results = {}
    for backend in (CPUBackend(), TorchBackend()):
        meta = make_meta(paged, prefix_lens, q_lens)
        meta.batch_invariant = True
        meta = prepared(backend, meta, paged.k_cache, q.shape[1])
        results[backend.name] = backend.extend(q, k, v, paged.k_cache, paged.v_cache, meta, 0.125)
    assert_close(results["cpu"], results["torch"].double(), dtype, f"seed {gen.initial_seed()}")


@pytest.mark.parametrize(
    "dtype, cache_dtype, head_dim, heads",
    [
        (torch.float16, torch.float16, 64, (4, 2)),  # no fp16 kernel
        (torch.float32, torch.float32, 272, (4, 2)),  # head_dim > the kernel's max
        (torch.bfloat16, torch.bfloat16, 264, (2, 1)),
        (torch.float32, torch.float32, 32, (17, 1)),  # group > the kernel's max
    ],
    ids=["fp16", "fp32_d272", "bf16_d264", "group17"],
)
def test_cpu_backend_falls_back_to_the_reference_where_the_kernel_cannot_run(
    gen, dtype, cache_dtype, head_dim, heads
) -> None:
    num_q_heads, num_kv_heads = heads
    seq_lens = [5, 300]
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 16, cache_dtype)
    q = make_q(gen, len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype)
    assert not native.supports(q, paged.k_cache)
    scale = head_dim**-0.5
    backend = CPUBackend()
    meta = prepared(backend, make_meta(paged, [s - 1 for s in seq_lens], [1, 1]), paged.k_cache, num_q_heads)
    assert not meta.backend_state.kernel
    out = backend.decode(q, paged.k_cache, paged.v_cache, meta, scale)
    assert_close(out, reference(q, paged, scale), dtype, f"seed {gen.initial_seed()}")


def test_native_kernels_off_selects_the_torch_reference() -> None:
    assert make_backend("auto", "cpu").name == "cpu"
    assert make_backend("auto", "cpu", native_kernels=False).name == "torch"
    with pytest.raises(ConfigError, match="native_kernels"):
        EngineConfig(attention_backend="cpu", native_kernels=False)


def test_cpu_backend_refuses_a_slot_past_the_cache_before_any_store() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    paged = Paged(k_cache, torch.zeros_like(k_cache), torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([8], dtype=torch.int32), 4)
    meta = make_meta(paged, [7], [1])
    meta.slot_mapping = torch.tensor([8])
    with pytest.raises(IndexError, match="out of range"):
        CPUBackend().prepare(meta, k_cache, 1)
