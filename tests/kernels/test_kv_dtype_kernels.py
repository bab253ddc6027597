"""The Triton kernels over pages stored apart from the compute dtype (EngineConfig.kv_dtype), in
fp32 compute on CPU under TRITON_INTERPRET=1 (or on a GPU): int8 pages quantized by store_kv to
the torch reference's bytes and read with their scales, and bf16 pages widened on load, in
decode (with cascade groups) and extend, against the torch reference over the same pages. fp8
e4m3 pages run the torch reference in the backend (kernels unwritten), so nothing here."""

from __future__ import annotations

import pytest
import torch

from radixkv.attention.torch_backend import TorchBackend, store_by_index_copy
from radixkv.attention.triton_backend import TritonBackend
from radixkv.cache.kv_dtype import SCALE_DTYPE, quantize_int8
from radixkv.kernels import CascadeGroups, extend_attention, paged_decode, store_kv
from radixkv.kernels.extend_attention import on_interpreter
from tests.kernels.test_attention_kernels import DEVICE, assert_matches, gen, make_case, poisoned_like, prepared  # noqa: F401 (gen)

PAGE_DTYPES = [torch.int8, torch.bfloat16]
# The interpreter casts fp32 to bf16 by truncation, not to nearest even as torch and the GPU
# do, so a kernel that rounds to bf16 (store_kv; extend rounding its own tokens as the store
# would) cannot match torch's bytes there.
ROUNDS_TO_BF16 = [torch.int8, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    on_interpreter(), reason="Triton's interpreter rounds fp32 to bf16 by truncation (round to nearest even on GPUs)"))]  # fmt: skip


def narrow_pages(case, dtype: torch.dtype):
    """The case's fp32 pages as the reference stores them in dtype: (k, v, k_scales, v_scales)."""
    if dtype != torch.int8:
        return case.k_cache.to(dtype), case.v_cache.to(dtype), None, None
    (k, k_scales), (v, v_scales) = quantize_int8(case.k_cache), quantize_int8(case.v_cache)
    return k, v, k_scales, v_scales


def reference(case, pages, decode: bool) -> torch.Tensor:
    backend = TorchBackend()
    k_cache, v_cache, k_scales, v_scales = pages
    meta = prepared(backend, case.meta, k_cache, case.q.shape[1])
    if decode:
        return backend.decode(case.q, k_cache, v_cache, meta, case.scale, k_scales, v_scales)
    return backend.extend(case.q, case.k, case.v, k_cache, v_cache, meta, case.scale, k_scales, v_scales)


@pytest.mark.parametrize("dtype", ROUNDS_TO_BF16, ids=str)
def test_store_kv_writes_the_references_bytes(gen, dtype) -> None:
    num_tokens, num_kv_heads, head_dim, page_size, num_pages = 20, 2, 32, 4, 8
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    kv = (torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen) * 3).to(DEVICE)
    kv[3, 1] = 0.0  # an all-zero row: scale 0
    kv[4, 0] = kv[4, 0] * 1e7  # a huge row: the scale clamps at fp16's largest, the row saturates
    kv[5, 1] = kv[5, 1] * 1e-6  # a tiny row: the scale clamps at fp16's smallest normal
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    slots = slots.to(DEVICE)
    caches = []
    for _ in range(2):
        k_cache, v_cache = torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE)
        scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=DEVICE) for _ in range(2)] if dtype == torch.int8 else [None, None]
        caches.append((k_cache, v_cache, *scales))
    store_by_index_copy(k, v, *caches[0][:2], slots, *caches[0][2:])
    store_kv(k, v, *caches[1][:2], slots, *caches[1][2:])
    for mine, theirs in zip(caches[1], caches[0], strict=True):
        assert mine is None or torch.equal(mine, theirs), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("dtype", ROUNDS_TO_BF16, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", [([0, 0], [37, 5]), ([19, 45], [7, 30]), ([64, 130, 17], [90, 1, 1])], ids=["no_prefix", "prefix", "mixed"])
def test_extend_over_narrow_pages_matches_the_reference(gen, shape, page_size, dtype) -> None:
    prefix_lens, q_lens = shape
    case = make_case(gen, prefix_lens, q_lens, 4, 2, head_dim=32, page_size=page_size, dtype=torch.float32)
    pages = narrow_pages(case, dtype)
    m = case.meta
    out = poisoned_like(case.q)
    extend_attention(case.q, case.k, case.v, pages[0], pages[1], m.cu_q_lens, m.seq_lens, m.page_table, m.max_q_len,
                     case.scale, out=out, k_scales=pages[2], v_scales=pages[3])  # fmt: skip
    assert_matches(out, reference(case, pages, decode=False), gen, f"extend over {dtype} pages")


@pytest.mark.parametrize("dtype", PAGE_DTYPES, ids=str)
@pytest.mark.parametrize("seq_lens", [[1, 2, 17], [250, 3, 1, 64]], ids=["short", "long_next_to_short"])
def test_decode_over_narrow_pages_matches_the_reference(gen, seq_lens, dtype) -> None:
    case = make_case(gen, [s - 1 for s in seq_lens], [1] * len(seq_lens), 8, 2, head_dim=32, page_size=16, dtype=torch.float32)
    pages = narrow_pages(case, dtype)
    m = case.meta
    out = paged_decode(case.q, pages[0], pages[1], m.seq_lens, m.page_table, m.max_seq_len, case.scale,
                       out=poisoned_like(case.q), k_scales=pages[2], v_scales=pages[3])  # fmt: skip
    assert_matches(out, reference(case, pages, decode=True), gen, f"decode over {dtype} pages")


@pytest.mark.parametrize("dtype", PAGE_DTYPES, ids=str)
def test_cascade_decode_over_narrow_pages_matches_the_reference(gen, dtype) -> None:
    """Three requests sharing their first 3 pages decode as one group over int8/bf16 pages."""
    page_size, shared = 16, 48
    case = make_case(gen, [69, 52, 80], [1, 1, 1], 8, 2, head_dim=32, page_size=page_size, dtype=torch.float32)
    m = case.meta
    m.page_table[1:, :3] = m.page_table[0, :3]  # the same first pages: the shared prefix
    pages = narrow_pages(case, dtype)
    groups = CascadeGroups(
        group_start=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), members=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        shared_len=torch.tensor([shared], dtype=torch.int32, device=DEVICE), own_begin=torch.full((3,), shared, dtype=torch.int32, device=DEVICE),
        max_shared_len=shared, max_members=3,
    )  # fmt: skip
    out = paged_decode(case.q, pages[0], pages[1], m.seq_lens, m.page_table, m.max_seq_len, case.scale,
                       out=poisoned_like(case.q), groups=groups, k_scales=pages[2], v_scales=pages[3])  # fmt: skip
    assert_matches(out, reference(case, pages, decode=True), gen, f"cascade decode over {dtype} pages")


def test_backend_forward_over_int8_pages_matches_the_reference(gen) -> None:
    """TritonBackend.forward (store + extend, then store + decode) over int8 pages, against the
    torch backend's forward over its own int8 pages: the same bytes stored, the same outputs."""
    prefix_lens, q_lens = [35, 0, 50], [12, 20, 1]
    case = make_case(gen, prefix_lens, q_lens, 8, 2, head_dim=32, page_size=16, dtype=torch.float32)
    results = []
    for backend in (TorchBackend(), TritonBackend(check_indices=True)):
        k_cache, v_cache, k_scales, v_scales = narrow_pages(case, torch.int8)
        for cache in (k_cache, v_cache):
            cache.view(-1, 2, 32)[case.meta.slot_mapping] = 0  # the step's own slots: written by the backend
        meta = prepared(backend, case.meta, k_cache, 8)
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta, case.scale, k_scales, v_scales)
        results.append((out, k_cache, v_cache, k_scales, v_scales))
    (want, *want_pages), (got, *got_pages) = results
    for mine, theirs in zip(got_pages, want_pages, strict=True):
        assert torch.equal(mine, theirs), f"seed {gen.initial_seed()}"
    assert_matches(got, want, gen, "triton forward over int8 pages")
