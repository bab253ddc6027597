"""The native CPU paged-decode kernel (radixkv/cpu/csrc/paged_decode.c) and the CPU backend over
it, both held to references that are neither: the backend to the pure-torch TorchBackend.

The kernel is held to a reference written here: each request's KV gathered through its page
table, softmax attention with GQA computed in float64 on the very same (already rounded)
inputs. Every test draws fresh random inputs (the seed is in failure messages); cache slots no
request owns hold a huge value, so a kernel reading past a request's length or through the
wrong page gives outputs far off; q is a strided slice of a fused qkv tensor, as in the model.

Shapes cover the kernel's instances: bf16 head_dim 64/128 with group <= 8 (the AVX-512 BF16
instances with constant shapes), head_dim 96 or group 12 (the general AVX-512 instance),
head_dim 48 (not a multiple of 32: the portable bf16 loop), and fp32 (the portable loop).
Lengths straddle the 256-token chunk edges and the 16-token page blocks; page size 7 makes
blocks cross pages.

Tolerances (absolute, plus a relative term for the bf16 output rounding):
- fp32: 1e-5 x max(1, sqrt(head_dim / 64)). Both sides compute in (at least) fp32; the
  kernel's fp32 loop sums each q.k sequentially, so its score error grows with head_dim
  (observed max ~6e-6 at head_dim 128 and ~1e-5 at 256, over a few hundred seeds).
- bf16: 2e-2 abs + 1e-2 rel. Inputs are exactly bf16, the kernel accumulates in fp32 and
  rounds its output to bf16 (2^-9 relative).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.attention import make_backend
from radixkv.attention.base import AttentionMetadata
from radixkv.attention.cpu_backend import CPUBackend
from radixkv.attention.torch_backend import TorchBackend
from radixkv.config import EngineConfig
from radixkv.cpu import decode as native
from radixkv.cpu import extend
from radixkv.cpu import native as native_library
from radixkv.cpu.features import cpu_features
from radixkv.errors import ConfigError

if native_library.load() is None:
    pytest.skip(
        "native paged-decode kernel unavailable (no C compiler, or its build failed)",
        allow_module_level=True,
    )

# (atol, rtol); float16 only for the gather fallback (SDPA in fp16).
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}
# Scales q so that scores q.k * scale have std ~ QUERY_GAIN: softmax is peaked, not uniform.
QUERY_GAIN = 3.0
UNWRITTEN = 1000.0
CHUNK_EDGE_LENS = [1, 15, 16, 17, 255, 256, 257, 600]
# (num_q_heads, num_kv_heads): GQA groups 1, 3, 4 and 12 (> 8: the general AVX-512 instance).
# (q heads, kv heads). group3: the default model's group, at a kv head count other than its own
# (the kernel's constant-count instance is SmolLM2-135M's 9/3, below). The last two have more
# query heads than one bf16 sweep covers (SPAN_ROWS, 16): their kv heads are read in spans, the
# last one partial.
HEADS = {
    "group1": (2, 2),
    "group3": (6, 2),
    "group4": (8, 2),
    "group12": (12, 1),
    "group6_spans": (18, 3),
    "group1_spans": (20, 20),
    "default_model": (9, 3),
}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: each case sees its own data, the same every run,
    so a failure reproduces (the seed is in its message). Hypothesis explores beyond these."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass
class Paged:
    """Requests' KV laid out in a pool of shuffled pages; slots nobody owns hold UNWRITTEN."""

    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    page_size: int


def make_paged(
    gen: torch.Generator,
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    spare_pages: int = 3,
) -> Paged:
    pages_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.zeros(
        len(seq_lens), max(pages_per_seq, default=0) + 1, dtype=torch.int32
    )
    used = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = order[used : used + n]
        used += n
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        owned[slots] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = UNWRITTEN
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Paged(k_cache, v_cache, page_table, lens, page_size)


def make_q(
    gen: torch.Generator,
    rows: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """q [rows, num_q_heads, head_dim] as a strided slice of a fused [rows, q + 2 kv] tensor."""
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=gen) * QUERY_GAIN).to(dtype)
    q = qkv[:, : num_q_heads * head_dim].view(rows, num_q_heads, head_dim)
    assert rows < 2 or not q.is_contiguous()
    return q


def reference(
    q: torch.Tensor, paged: Paged, scale: float, rows: list[int] | None = None
) -> torch.Tensor:
    """[B, num_q_heads, head_dim] float64: request b's query row (rows[b], or b) over its KV."""
    num_q_heads = q.shape[1]
    num_kv_heads, head_dim = paged.k_cache.shape[2:]
    group = num_q_heads // num_kv_heads
    outs = []
    for b, seq_len in enumerate(paged.seq_lens.tolist()):
        pages = paged.page_table[b, : math.ceil(seq_len / paged.page_size)].long()
        keys = (
            paged.k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        )
        values = (
            paged.v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        )
        # Query heads h*group .. h*group+group-1 share kv head h.
        keys, values = (
            keys.repeat_interleave(group, dim=1),
            values.repeat_interleave(group, dim=1),
        )
        query = q[b if rows is None else rows[b]].double()
        probs = (torch.einsum("hd,thd->ht", query, keys) * scale).softmax(-1)
        outs.append(torch.einsum("ht,thd->hd", probs, values))
    return (
        torch.stack(outs)
        if outs
        else torch.empty(0, num_q_heads, head_dim, dtype=torch.float64)
    )


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    atol, rtol = TOLERANCE[dtype]
    if dtype == torch.float32:
        atol *= max(1.0, math.sqrt(out.shape[-1] / 64))
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    torch.testing.assert_close(
        out.double(), ref.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def test_inputs_make_softmax_peaked(gen) -> None:
    """The generated scores are large enough that attention is far from uniform, so a kernel
    reading the wrong keys or dropping some cannot pass by averaging."""
    paged = make_paged(gen, [600], 2, 64, 16, torch.float32)
    q = make_q(gen, 1, 2, 2, 64, torch.float32)
    keys = paged.k_cache[paged.page_table[0, :38].long()].reshape(-1, 2, 64)[:600]
    probs = (torch.einsum("hd,thd->ht", q[0], keys) * 64**-0.5).softmax(-1)
    assert probs.max(-1).values.mean() > 20 / 600, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("head_dim", [48, 64, 96, 128])
def test_paged_decode_matches_reference(gen, head_dim, heads, page_size, dtype) -> None:
    num_q_heads, num_kv_heads = heads
    paged = make_paged(gen, CHUNK_EDGE_LENS, num_kv_heads, head_dim, page_size, dtype)
    q = make_q(gen, len(CHUNK_EDGE_LENS), num_q_heads, num_kv_heads, head_dim, dtype)
    assert native.supports(q, paged.k_cache)
    scale = head_dim**-0.5
    out = native.paged_decode(
        q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, scale
    )
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    ref = reference(q, paged, scale)
    for b, seq_len in enumerate(CHUNK_EDGE_LENS):
        assert_close(
            out[b], ref[b], dtype, f"seq_len {seq_len} (seed {gen.initial_seed()})"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_largest_head_dim_and_group(gen, dtype) -> None:
    """The kernel's buffer limits: head_dim 256 (MAX_HEAD_DIM) and group 16 (MAX_GROUP)."""
    seq_lens = [257, 3, 40]
    for head_dim, (num_q_heads, num_kv_heads) in (
        (256, (4, 2)),
        (64, (16, 1)),
        (256, (16, 1)),
    ):
        paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 7, dtype)
        q = make_q(gen, len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype)
        assert native.supports(q, paged.k_cache)
        scale = head_dim**-0.5
        out = native.paged_decode(
            q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, scale
        )
        what = f"head_dim {head_dim}, heads {num_q_heads}/{num_kv_heads} (seed {gen.initial_seed()})"
        assert_close(out, reference(q, paged, scale), dtype, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_rows_write_only_the_named_rows(gen, head_dim, dtype) -> None:
    """With rows=, request b reads q row rows[b] and writes out row rows[b]; other rows of the
    given out keep their values."""
    seq_lens = [300, 1, 17, 256]
    rows = [7, 2, 5, 0]
    num_rows, num_q_heads, num_kv_heads = 9, 8, 2
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 7, dtype)
    q = make_q(gen, num_rows, num_q_heads, num_kv_heads, head_dim, dtype)
    sentinel = torch.randn(num_rows, num_q_heads, head_dim, generator=gen).to(dtype)
    out = sentinel.clone()
    scale = head_dim**-0.5
    ref = reference(q, paged, scale, rows=rows)
    # The wrapper converts the row indices to int32.
    for rows_dtype in (torch.int32, torch.int64):
        out.copy_(sentinel)
        result = native.paged_decode(
            q,
            paged.k_cache,
            paged.v_cache,
            paged.page_table,
            paged.seq_lens,
            scale,
            rows=torch.tensor(rows, dtype=rows_dtype),
            out=out,
        )
        assert result.data_ptr() == out.data_ptr()
        others = [r for r in range(num_rows) if r not in rows]
        assert torch.equal(out[others], sentinel[others]), (
            "rows no request names were written"
        )
        for b, row in enumerate(rows):
            assert_close(
                out[row],
                ref[b],
                dtype,
                f"request {b} -> row {row} (seed {gen.initial_seed()})",
            )
    # Without out, the result has q's shape and the named rows are filled.
    fresh = native.paged_decode(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.page_table,
        paged.seq_lens,
        scale,
        rows=torch.tensor(rows),
    )
    assert fresh.shape == q.shape
    assert torch.equal(fresh[rows], out[rows])


def test_zero_length_request_does_not_shift_its_neighbours(gen) -> None:
    """A request with no keys owns no chunk: the requests after it still find their own chunks."""
    seq_lens = [300, 0, 257, 0, 5]
    paged = make_paged(gen, seq_lens, 2, 64, 16, torch.float32)
    q = make_q(gen, len(seq_lens), 4, 2, 64, torch.float32)
    out = native.paged_decode(
        q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125
    )
    live = [0, 2, 4]
    live_paged = Paged(
        paged.k_cache, paged.v_cache, paged.page_table[live], paged.seq_lens[live], 16
    )
    assert_close(
        out[live],
        reference(q, live_paged, 0.125, rows=live),
        torch.float32,
        f"seed {gen.initial_seed()}",
    )
    # An empty softmax sum is written as 0.
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


# (head_dim, (num_q_heads, num_kv_heads)): a specialised AVX-512 instance, the general
# one, the portable loop.
INVARIANCE_SHAPES = {
    "d64_g4": (64, (8, 2)),
    "d96_g12": (96, (12, 1)),
    "d48_g3": (48, (6, 2)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", list(INVARIANCE_SHAPES.values()), ids=list(INVARIANCE_SHAPES)
)
def test_output_is_batch_and_thread_invariant(gen, shape, dtype) -> None:
    """A request's output is bit-identical alone or beside requests of other lengths, and with
    1 or 2 threads: chunk edges depend only on its own length."""
    head_dim, (num_q_heads, num_kv_heads) = shape
    seq_lens = [37, 600, 700, 1, 257, 256, 3]
    targets = [1, 3, 4]  # lengths 600, 1 and 257, beside others
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, 7, dtype)
    q = make_q(gen, len(seq_lens), num_q_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    results = []
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            batch = native.paged_decode(
                q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, scale
            )
            alone = [
                native.paged_decode(
                    q[b : b + 1],
                    paged.k_cache,
                    paged.v_cache,
                    paged.page_table[b : b + 1],
                    paged.seq_lens[b : b + 1],
                    scale,
                )[0]
                for b in targets
            ]
            results.append((num_threads, batch, alone))
    finally:
        torch.set_num_threads(threads)
    _, first_batch, _ = results[0]
    for num_threads, batch, alone in results:
        assert torch.equal(batch, first_batch), (
            f"batch output differs at {num_threads} threads"
        )
        for b, single in zip(targets, alone, strict=True):
            assert torch.equal(single, first_batch[b]), (
                f"request {b} (length {seq_lens[b]}) alone at {num_threads} threads != in the batch"
            )
    ref = reference(q, paged, scale)
    assert_close(first_batch, ref, dtype, f"seed {gen.initial_seed()}")


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 16),
    head_dim=st.one_of(st.sampled_from([32, 64, 96, 128, 256]), st.integers(1, 80)),
    page_size=st.integers(1, 20),
    seq_lens=st.lists(st.integers(1, 700), min_size=1, max_size=4),
    extra_rows=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_decode_matches_reference_property(
    dtype, num_kv_heads, group, head_dim, page_size, seq_lens, extra_rows, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, page_size, dtype)
    num_rows = len(seq_lens) + extra_rows
    q = make_q(gen, num_rows, num_q_heads, num_kv_heads, head_dim, dtype)
    rows = (
        torch.randperm(num_rows, generator=gen)[: len(seq_lens)].tolist()
        if extra_rows
        else None
    )
    assert native.supports(q, paged.k_cache)
    scale = head_dim**-0.5
    out = native.paged_decode(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.page_table,
        paged.seq_lens,
        scale,
        rows=None if rows is None else torch.tensor(rows),
    )
    ref = reference(q, paged, scale, rows=rows)
    got = out if rows is None else out[rows]
    assert_close(got, ref, dtype, "property")


def make_meta(
    paged: Paged, prefix_lens: list[int], q_lens: list[int]
) -> AttentionMetadata:
    """Metadata for B requests, request b computing q_lens[b] tokens after prefix_lens[b] cached ones."""
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    assert seq_lens == paged.seq_lens.tolist()
    positions = torch.cat(
        [torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]
    )
    request = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    pages = paged.page_table.long()[request, positions // paged.page_size]
    cu_q_lens = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_q_lens[1:] = torch.tensor(q_lens).cumsum(0)
    return AttentionMetadata(
        positions=positions,
        slot_mapping=pages * paged.page_size + positions % paged.page_size,
        page_table=paged.page_table,
        cu_q_lens=cu_q_lens,
        q_lens=torch.tensor(q_lens, dtype=torch.int32),
        seq_lens=paged.seq_lens,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        page_size=paged.page_size,
        q_lens_list=list(q_lens),
        seq_lens_list=seq_lens,
    )


def prepared(backend, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int) -> AttentionMetadata:
    """meta with backend's per-step state, as CausalLM.forward sets it at the start of a step."""
    return backend.begin_step(meta, k_cache, num_q_heads)


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
    the prefill kernel where it takes the shapes (test_native_extend tests it), else through the
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


def test_kernel_limits_come_from_the_library() -> None:
    limits = native.limits()
    assert (limits.max_head_dim, limits.max_group) == (256, 16)  # MAX_HEAD_DIM, MAX_GROUP in paged_decode.c
    cache = torch.zeros(2, 16, 1, limits.max_head_dim)
    assert native.supports(torch.zeros(1, limits.max_group, limits.max_head_dim), cache)
    assert not native.supports(torch.zeros(1, limits.max_group + 1, limits.max_head_dim), cache)


def test_supports_rejects_other_inputs() -> None:
    cache = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(3, 4, 64)
    assert native.supports(q, cache)
    assert not native.supports(q.half(), cache.half())
    assert not native.supports(q, cache.bfloat16())  # dtypes differ
    assert not native.supports(q.bfloat16(), cache)
    assert not native.supports(torch.zeros(3, 4, 257), torch.zeros(4, 16, 2, 257))
    assert native.supports(torch.zeros(3, 4, 256), torch.zeros(4, 16, 2, 256))
    # Query heads not a multiple of kv heads; pages not contiguous; head dim strided.
    assert not native.supports(torch.zeros(3, 3, 64), cache)
    assert not native.supports(q, cache.transpose(0, 1))
    assert not native.supports(torch.zeros(3, 64, 4).transpose(1, 2), cache)


def test_native_kernels_off_selects_the_torch_reference() -> None:
    assert make_backend("auto", "cpu").name == "cpu"
    assert make_backend("auto", "cpu", native_kernels=False).name == "torch"
    with pytest.raises(ConfigError, match="native_kernels"):
        EngineConfig(attention_backend="cpu", native_kernels=False)


def test_bad_indices_and_buffers_are_rejected_before_the_kernel_runs(gen) -> None:
    """The C kernel trusts its indices: the wrapper refuses what would read or write out of bounds."""
    paged = make_paged(gen, [20, 9], 2, 64, 16, torch.float32)
    q = make_q(gen, 2, 4, 2, 64, torch.float32)
    k, v, table, lens = paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens
    num_pages, width = k.shape[0], table.shape[1]
    bad_page = table.clone()
    bad_page[1, 0] = num_pages
    cases = {
        "page id past the pool": {"page_table": bad_page},
        "negative page id": {"page_table": table.clone().fill_(-1)},
        "length past the page table": {
            "seq_lens": torch.tensor([20, width * 16 + 1], dtype=torch.int32)
        },
        "negative length": {"seq_lens": torch.tensor([20, -1], dtype=torch.int32)},
        "row past q": {"rows": torch.tensor([0, 2])},
        "more requests than q rows": {
            "page_table": table[[0, 1, 1]],
            "seq_lens": torch.tensor([20, 9, 9], dtype=torch.int32),
        },
        "page table rows != requests": {"page_table": table[:1]},
        "v_cache of another dtype": {"v_cache": v.bfloat16()},
        "v_cache not contiguous": {
            "v_cache": v.transpose(2, 3).contiguous().transpose(2, 3)
        },
        "out of the wrong shape": {"out": torch.empty(3, 4, 64)},
        "out not contiguous": {"out": torch.empty(4, 2, 64).transpose(0, 1)},
    }
    for what, change in cases.items():
        args = {
            "q": q,
            "k_cache": k,
            "v_cache": v,
            "page_table": table,
            "seq_lens": lens,
            "scale": 0.125,
        } | change
        with pytest.raises((ValueError, IndexError)):
            native.paged_decode(**args)
            pytest.fail(f"accepted {what}")
    # The valid call still runs.
    out = native.paged_decode(q, k, v, table, lens, 0.125)
    assert_close(
        out, reference(q, paged, 0.125), torch.float32, f"seed {gen.initial_seed()}"
    )


def test_store_kv_writes_strided_rows_into_their_slots_and_skips_negative_ones() -> None:
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        num_pages, page_size, kv_heads, head_dim, tokens = 6, 4, 2, 8, 5
        k_cache = torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype)
        k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
        v = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
        slots = torch.tensor([3, 17, -1, 0, 23])
        assert native.store_kv(k, v, k_cache, v_cache, slots)
        expected_k = torch.zeros(num_pages * page_size, kv_heads, head_dim, dtype=dtype)
        expected_v = torch.zeros_like(expected_k)
        keep = slots >= 0
        expected_k[slots[keep]] = k[keep]
        expected_v[slots[keep]] = v[keep]
        assert torch.equal(k_cache.view_as(expected_k), expected_k)
        assert torch.equal(v_cache.view_as(expected_v), expected_v)


def test_cpu_backend_refuses_a_slot_past_the_cache_before_any_store() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    paged = Paged(k_cache, torch.zeros_like(k_cache), torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([8], dtype=torch.int32), 4)
    meta = make_meta(paged, [7], [1])
    meta.slot_mapping = torch.tensor([8])
    with pytest.raises(IndexError, match="out of range"):
        CPUBackend().prepare(meta, k_cache, 1)


# The builds a user on another CPU runs, compiled here: no AVX2 at all (the portable loops), AVX2
# without AVX-512 (Haswell to Alder Lake, AMD Zen 1-3: the 8-lane items), and AVX-512 without
# BF16 (Skylake to Ice Lake: fp32 items in 16 lanes, bf16 in 8).
OTHER_BUILDS = [
    pytest.param("x86-64-v2", id="portable"),
    pytest.param(
        "x86-64-v3", id="avx2",
        marks=pytest.mark.skipif(not cpu_features().avx2, reason="needs avx2 and fma to run that build"),
    ),
    pytest.param(
        "skylake-avx512", id="avx512-without-bf16",
        marks=pytest.mark.skipif(not cpu_features().avx512, reason="needs avx512f and avx512bw to run that build"),
    ),
]  # fmt: skip


@pytest.mark.skipif(cpu_features().machine != "x86_64", reason="the builds are x86-64 ones")
@pytest.mark.parametrize("march", OTHER_BUILDS)
def test_builds_for_other_cpus_give_the_same_answers(gen, monkeypatch, tmp_path, march) -> None:
    # Built into a scratch cache and held to the same reference: decode (with and without
    # cascade groups) and row ops alike.
    from radixkv.cpu import row_ops
    from radixkv.engine.sampler import greedy_tokens

    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in native_library.COMPILE_FLAGS)
    monkeypatch.setattr(native_library, "COMPILE_FLAGS", flags)
    monkeypatch.setattr(native_library, "_tried", False)
    monkeypatch.setattr(native_library, "_library", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = native_library.load()
    assert library is not None and str(tmp_path) in library._name
    assert library.radixkv_decode_use_amx(1) == 0  # neither build has the AMX path
    # Nor a native bf16 linear (oneDNN runs them); the fp32 one wherever AVX2 is.
    assert library.radixkv_linear_kernels() == (0 if march == "x86-64-v2" else 4)
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 40):  # 40: not a multiple of 16, the portable item in every build
            paged = make_paged(gen, [1, 16, 300], num_kv_heads=3, head_dim=head_dim, page_size=16, dtype=dtype)
            q = make_q(gen, 3, 9, 3, head_dim, dtype)
            out = native.paged_decode(q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
            assert_close(out, reference(q, paged, 0.125), dtype, f"{march} build, head_dim {head_dim}")
            # Cascade groups: three requests over one 256-token cached prefix (its 16 pages shared).
            grouped = make_paged(gen, [300, 310, 290], num_kv_heads=3, head_dim=head_dim, page_size=16, dtype=dtype)
            grouped.page_table[1:, :16] = grouped.page_table[0, :16]
            plan = native.cascade_plan(grouped.page_table, grouped.seq_lens, 16, min_shared_tokens=16, min_group_members=2)
            assert plan.saved_tokens == 2 * 256
            out = native.paged_decode(q, grouped.k_cache, grouped.v_cache, grouped.page_table, grouped.seq_lens, 0.125, plan=plan.plan)
            assert_close(out, reference(q, grouped, 0.125), dtype, f"{march} build, cascade, head_dim {head_dim}")
        # Prefill attention: the fp32 kernel needs AVX2 (8 lanes) or AVX-512 (16), the bf16 one
        # AVX512_BF16; elsewhere the backend keeps the torch reference.
        assert extend.fits(dtype, 64, 3) == (march != "x86-64-v2" and dtype == torch.float32)
        if extend.fits(dtype, 64, 3):
            from tests.attention.test_native_extend import REQUESTS, run_case

            out, rows, expected = run_case(gen, REQUESTS, (9, 3), 64, 16, dtype)
            assert_close(out[rows], expected, dtype, f"{march} build, prefill")
    x, delta, weight = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((5, 64), (5, 64), (64,)))
    expected = row_ops.rms_norm(x + delta, weight, 1e-5)
    assert torch.equal(row_ops.add_rms_norm(x.clone(), delta, weight, 1e-5)[1], expected)
    logits = torch.randn(3, 1000, generator=gen)
    logits[1, 7], logits[2, 900] = float("nan"), logits[2].max() + 1.0
    assert torch.equal(greedy_tokens(logits), logits.max(dim=-1).indices)  # the sampler's argmax


@pytest.mark.skipif(not cpu_features().amx_bf16, reason="needs AMX tiles (amx_bf16)")
def test_decode_amx_setting_picks_the_q_k_path(gen) -> None:
    # decode_amx=False keeps q.k on AVX-512 even after the AMX linears were granted tiles:
    # both paths meet the reference, and they sum in different orders, so some bits differ.
    native_library.load().radixkv_linear_kernels()  # the linears ask the OS for tiles too
    paged = make_paged(gen, [300, 17, 64, 600, 255, 999], num_kv_heads=3, head_dim=64, page_size=16, dtype=torch.bfloat16)
    q = make_q(gen, 6, 9, 3, 64, torch.bfloat16)
    expected = reference(q, paged, 0.125)
    outputs = {}
    try:
        for setting in (False, True):
            CPUBackend(decode_amx=setting)  # applies the setting to the library
            outputs[setting] = native.paged_decode(q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125)
            assert_close(outputs[setting], expected, torch.bfloat16, f"decode_amx={setting}")
    finally:
        native_library.load().radixkv_decode_use_amx(1)
    assert not torch.equal(outputs[False], outputs[True])


def test_decode_amx_off_is_off() -> None:
    library = native_library.load()
    try:
        CPUBackend(decode_amx=False)
        assert library.radixkv_decode_use_amx(0) == 0
    finally:
        library.radixkv_decode_use_amx(1)
