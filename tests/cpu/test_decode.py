"""The native CPU paged-decode kernel (radixkv/cpu/decode.py over csrc/paged_decode.c) and its
cascade groups (csrc/cascade.c), held to the float64 reference of tests/helpers/paged.py, which
says how inputs are drawn and the tolerances.

Shapes cover the kernel's instances: bf16 head_dim 64/128 with group <= 8 (the AVX-512 BF16
instances with constant shapes), head_dim 96 or group 12 (the general AVX-512 instance),
head_dim 48 (not a multiple of 32: the portable bf16 loop), and fp32 (the portable loop).
Lengths straddle the 256-token chunk edges and the 16-token page blocks; page size 7 makes
blocks cross pages.

Cascade decode: requests that share a cached prefix read its KV once per step as a group, and
merge it by log-sum-exp with their own suffix; its output must match the same reference within
the same tolerances, for every grouping, and the plan must group exactly the requests that
share enough whole pages.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.helpers.paged import Paged, assert_close, gen, make_paged, make_q, reference  # noqa: F401  (gen is a fixture)

from radixkv.attention.cpu_backend import CPUBackend
from radixkv.cache.kv_dtype import dequantize, quantize_int8
from radixkv.cpu import decode as native
from radixkv.cpu import extend, mxfp4
from radixkv.cpu import native as native_library
from radixkv.cpu.features import cpu_features

if native_library.load() is None:
    pytest.skip(
        "native paged-decode kernel unavailable (no C compiler, or its build failed)",
        allow_module_level=True,
    )

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_into_int8_pages_writes_the_torch_stores_bytes(dtype) -> None:
    """fp32 and bf16 rows (the fused step's and the layer loop's, under either compute dtype)
    into int8 pages: the native store writes the bytes and scales the torch store writes
    (quantize_int8), zero, huge and tiny rows included, and skips negative slots."""
    from radixkv.attention.torch_backend import store_by_index_copy

    gen = torch.Generator().manual_seed(6)
    num_pages, page_size, kv_heads, head_dim, tokens = 5, 4, 3, 16, 6
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    k[1, 0], k[2, 1], v[3, 2] = 0.0, k[2, 1] * 1e30, v[3, 2] * 1e-30
    slots = torch.tensor([3, 17, -1, 0, 19, 8])
    pages = []
    for store in ("native", "torch"):
        k_cache = torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=torch.int8)
        v_cache = torch.zeros_like(k_cache)
        k_scales = torch.zeros(num_pages, page_size, kv_heads, dtype=torch.float16)
        v_scales = torch.zeros_like(k_scales)
        if store == "native":
            assert native.store_kv(k, v, k_cache, v_cache, slots, k_scales, v_scales)
        else:
            store_by_index_copy(k, v, k_cache, v_cache, slots, k_scales, v_scales)
        pages.append((k_cache, v_cache, k_scales, v_scales))
    for mine, theirs in zip(*pages, strict=True):
        assert torch.equal(mine, theirs)
    assert pages[0][2].view(-1, kv_heads)[slots[0]].ne(0).all()  # something was stored


def narrow_pages(paged, kv_dtype: torch.dtype):
    """paged's K and V stored as kv_dtype (k_cache, v_cache, and paged_decode's scale keywords),
    and a Paged of what they hold, widened to fp32, for the reference."""
    if kv_dtype == torch.int8:
        (k, k_scales), (v, v_scales) = quantize_int8(paged.k_cache), quantize_int8(paged.v_cache)
        wide_k, wide_v = dequantize(k, k_scales, torch.float32), dequantize(v, v_scales, torch.float32)
        scales = {"k_scales": k_scales, "v_scales": v_scales}
    else:
        k, v = paged.k_cache.to(kv_dtype), paged.v_cache.to(kv_dtype)
        wide_k, wide_v, scales = k.float(), v.float(), {}
    return (k, v, scales), Paged(wide_k, wide_v, paged.page_table, paged.seq_lens, paged.page_size)


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
    # cascade groups, with sinks), prefill, row ops and the MXFP4 experts alike.
    from radixkv.cpu import row_ops
    from radixkv.engine.sampler import greedy_tokens
    from radixkv.model.row_ops import rms_norm

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
            sinks = torch.randn(9, generator=gen) * 3  # gpt-oss's, merged in the build's own code
            out = native.paged_decode(q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, 0.125, sinks=sinks)
            assert_close(out, reference(q, paged, 0.125, sinks=sinks), dtype, f"{march} build, sinks, head_dim {head_dim}")
            # Cascade groups: three requests over one 256-token cached prefix (its 16 pages shared).
            grouped = make_paged(gen, [300, 310, 290], num_kv_heads=3, head_dim=head_dim, page_size=16, dtype=dtype)
            grouped.page_table[1:, :16] = grouped.page_table[0, :16]
            plan = native.cascade_plan(grouped.page_table, grouped.seq_lens, 16, min_shared_tokens=16, min_group_members=2)
            assert plan.saved_tokens == 2 * 256
            out = native.paged_decode(q, grouped.k_cache, grouped.v_cache, grouped.page_table, grouped.seq_lens, 0.125, plan=plan.plan)
            assert_close(out, reference(q, grouped, 0.125), dtype, f"{march} build, cascade, head_dim {head_dim}")
            # Batch-invariant groups: each member the plain kernel's bits.
            exact = native.batch_invariant_plan(plan, 3)
            assert exact.saved_tokens == 2 * 256
            args = (q, grouped.k_cache, grouped.v_cache, grouped.page_table, grouped.seq_lens, 0.125)
            assert torch.equal(native.paged_decode(*args, plan=exact.plan), native.paged_decode(*args))
            # Narrower pages, widened on load: bf16 under fp32 compute, int8 under either.
            for kv_dtype in (torch.bfloat16, torch.int8) if dtype == torch.float32 else (torch.int8,):
                (k, v, scales), wide = narrow_pages(paged, kv_dtype)
                out = native.paged_decode(q, k, v, paged.page_table, paged.seq_lens, 0.125, **scales)
                assert_close(out, reference(q, wide, 0.125), dtype, f"{march} build, {kv_dtype} pages, head_dim {head_dim}")
        # Prefill attention: the fp32 kernel needs AVX2 (8 lanes) or AVX-512 (16), the bf16 one
        # AVX512_BF16; elsewhere the backend keeps the torch reference.
        assert extend.fits(dtype, 64, 3) == (march != "x86-64-v2" and dtype == torch.float32)
        if extend.fits(dtype, 64, 3):
            from tests.cpu.test_extend import REQUESTS, run_case

            out, rows, expected = run_case(gen, REQUESTS, (9, 3), 64, 16, dtype)
            assert_close(out[rows], expected, dtype, f"{march} build, prefill")
    # MXFP4 experts: each path the build has, the reference's bits.
    from tests.cpu.test_mxfp4 import test_every_path_gives_the_references_bits

    paths = {"x86-64-v2": ["portable"], "x86-64-v3": ["avx2", "portable"]}.get(march, ["avx512", "avx2", "portable"])
    assert mxfp4.compiled_kernels() == paths
    for kernel in mxfp4.compiled_kernels():
        test_every_path_gives_the_references_bits(kernel, 70, 96, True)
    x, delta, weight = (torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in ((5, 64), (5, 64), (64,)))
    expected = rms_norm(x + delta, weight, 1e-5)
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


# ---- Cascade decode (csrc/cascade.c) ----

PAGE = 16


class Tables:
    """A pool of shuffled pages and requests in groups: each group's members hold the same pages
    for its prefix's whole pages (as the radix tree hands them out), then pages of their own.
    A prefix ending mid-page leaves its last page private: the tree shares whole blocks only."""

    def __init__(self, gen, groups: list[tuple[int, int]], own_tokens: list[int], heads: tuple[int, int], head_dim: int, dtype, roots: int = 0):
        num_q_heads, num_kv_heads = heads
        total_pages = roots + sum(-(-prefix // PAGE) for prefix, _ in groups) + sum(-(-own // PAGE) + 1 for own in own_tokens) + 4
        shape = (total_pages, PAGE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        free = torch.randperm(total_pages, generator=gen).tolist()
        root = [free.pop() for _ in range(roots)]  # pages every group starts with
        rows, lens, self.shared_pages = [], [], []
        member = 0
        for prefix, size in groups:
            full = prefix // PAGE
            shared = root + [free.pop() for _ in range(full)]
            for _ in range(size):
                length = roots * PAGE + prefix + own_tokens[member]
                pages = shared + [free.pop() for _ in range(-(-length // PAGE) - len(shared))]
                rows.append(pages)
                lens.append(length)
                member += 1
            self.shared_pages.append(len(shared))
        width = max(map(len, rows))
        self.page_table = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, pages in enumerate(rows):
            self.page_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.groups = groups
        self.q = make_q(gen, len(rows), num_q_heads, num_kv_heads, head_dim, dtype)

    def paged(self) -> Paged:
        return Paged(self.k_cache, self.v_cache, self.page_table, self.seq_lens, PAGE)

    def expected_saved_tokens(self, min_tokens: int, min_members: int) -> int:
        """Groups of at least min_members sharing at least min_tokens of whole pages save
        (members - 1) reads of those pages."""
        return sum(
            (size - 1) * pages * PAGE
            for (_, size), pages in zip(self.groups, self.shared_pages)
            if size >= max(2, min_members) and pages * PAGE >= min_tokens
        )


# The kernel tests group every pair sharing a page; the engine's thresholds are tested apart.
ANY_SHARING = dict(min_shared_tokens=PAGE, min_group_members=2)


def check_cascade(t: Tables, dtype, what: str, **thresholds) -> native.CascadePlan:
    scale = t.q.shape[-1] ** -0.5
    plan = native.cascade_plan(t.page_table, t.seq_lens, PAGE, **(thresholds or ANY_SHARING))
    cascade = native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale, plan=plan.plan)
    plain = native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale)
    expected = reference(t.q, t.paged(), scale)
    assert_close(cascade, expected, dtype, f"{what}: cascade")
    assert_close(plain, expected, dtype, f"{what}: plain")
    return plan


CASES = [
    # (groups of (prefix tokens, members), GQA (q heads, kv heads), head_dim)
    ([(1024, 2), (1024, 2)], (9, 3), 64),
    ([(700, 3), (300, 1), (517, 2)], (8, 8), 64),  # prefixes off the page and chunk grid, a group of 1
    ([(1024, 64)], (8, 1), 64),  # one group of 64, GQA 8
    ([(300, 3), (280, 5)], (6, 2), 128),  # head_dim 128, GQA 3
    ([(512, 5), (256, 4)], (6, 2), 40),  # head_dim 40: the member-by-member fallback (bf16 and fp32)
    ([(260, 2), (600, 2)], (6, 2), 96),  # head_dim 96: the general vector instance
    ([(0, 3), (40, 2)], (4, 4), 64),  # nothing long enough to share
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "heads", "head_dim"), CASES)
def test_cascade_matches_the_reference_for_every_grouping(gen, dtype, groups, heads, head_dim):
    own = torch.randint(1, 90, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=heads, head_dim=head_dim, dtype=dtype)
    plan = check_cascade(t, dtype, f"{groups} {heads} d{head_dim}")
    assert plan.saved_tokens == t.expected_saved_tokens(PAGE, 2)
    assert (plan.plan is None) == (plan.saved_tokens == 0)


@pytest.fixture
def cascade_tiles_off():
    """The member-by-member shared path (EngineConfig.cascade_tiles=False) for one test."""
    assert native.use_cascade_tiles(False) is False
    yield
    native.use_cascade_tiles(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "heads", "head_dim"), CASES[:4])
def test_cascade_without_tiles_matches_the_reference_and_the_tiles(gen, cascade_tiles_off, dtype, groups, heads, head_dim):
    # Tiles off: each member runs the plain kernel over the shared keys, so the groups' output
    # is the plain kernel's up to the merge; both paths stay within the reference's tolerance,
    # on any CPU (with AVX512_BF16 the bf16 tiles are vdpbf16ps, elsewhere tiles in fp32 only).
    own = torch.randint(1, 90, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=heads, head_dim=head_dim, dtype=dtype)
    plan = check_cascade(t, dtype, f"tiles off: {groups} {heads} d{head_dim}")
    scale = t.q.shape[-1] ** -0.5
    members = native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale, plan=plan.plan)
    assert native.use_cascade_tiles(True) is True
    tiles = native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale, plan=plan.plan)
    assert_close(members, tiles, dtype, "tiles on against off")


def test_default_thresholds_group_by_the_bytes_they_save(gen):
    # SmolLM2's heads (GQA 3) in bf16 pages, a 512 KiB L2: a group needs 6 members (18 query
    # heads per KV head), 256 shared tokens (a chunk), and to save (members - 1) x shared tokens
    # of one layer's K and V that fill 4 L2s (2,731 tokens of 768 bytes). Four over 2,048 tokens,
    # six over 240 and six over 512 (saves 2,560) decode on their own; six over 1,024 (saves
    # 5,120), 16 over 256 (saves 3,840) and 16 over 700 (688 in whole pages) form groups.
    thresholds = native.cascade_thresholds(9, 3, 64, 2, l2_bytes=512 << 10)
    assert thresholds == dict(min_shared_tokens=256, min_group_members=6, min_saved_tokens=2731)
    assert native.min_saved_tokens(8, 64, 4, l2_bytes=512 << 10) == 512
    assert native.min_members(1) == 18 and native.min_members(4) == 5 and native.min_members(8) == 3
    groups = [(2048, 4), (240, 6), (512, 6), (1024, 6), (256, 16), (700, 16)]
    own = torch.randint(1, 40, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    plan = check_cascade(t, torch.bfloat16, "default thresholds", **thresholds)
    assert plan.saved_tokens == 5 * 1024 + 15 * 256 + 15 * 688


def test_plan_groups_by_the_deepest_prefix_that_saves_most(gen):
    # Four system prompts of 1,024 tokens after a common 2-page root (the chat template's start):
    # one group of 64 sharing 2 pages saves 63 x 32 reads; four groups of 16 sharing 66 pages
    # each save 4 x 15 x 1,056, so the plan takes the four.
    own = torch.randint(1, 60, (64,), generator=gen).tolist()
    t = Tables(gen, [(1024, 16)] * 4, own, heads=(9, 3), head_dim=64, dtype=torch.bfloat16, roots=2)
    plan = check_cascade(t, torch.bfloat16, "four prompts over a common root")
    assert int(plan.plan[0]) == 4
    assert plan.saved_tokens == 4 * 15 * (1024 + 2 * PAGE)


def test_members_joining_and_leaving_between_steps(gen):
    # Step by step a group grows and shrinks (requests join, finish, are preempted): the plan is
    # rebuilt from each step's tables and the output always matches the reference.
    own = [30, 50, 70, 90, 110]
    t = Tables(gen, [(768, 5)], own, heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    for members in ([0], [0, 1], [0, 1, 2, 3, 4], [1, 3], [4]):
        index = torch.tensor(members)
        sub = Tables.__new__(Tables)
        sub.k_cache, sub.v_cache, sub.q = t.k_cache, t.v_cache, t.q[index]
        sub.page_table, sub.seq_lens = t.page_table[index].contiguous(), t.seq_lens[index].contiguous()
        plan = check_cascade(sub, torch.bfloat16, f"members {members}")
        assert plan.saved_tokens == 768 * (len(members) - 1)


def test_a_member_whose_whole_sequence_is_shared(gen):
    # Two requests over the very same full pages (no own keys left): the merge takes the shared
    # states alone.
    t = Tables(gen, [(512, 3)], [0, 0, 16], heads=(4, 2), head_dim=64, dtype=torch.float32)
    plan = check_cascade(t, torch.float32, "no own keys")
    assert plan.saved_tokens == 2 * 512


def test_cascade_rows_of_a_mixed_step(gen):
    # In a mixed step the decoding requests' q and out rows sit among prefill rows: each request
    # (and each group member) reads and writes only its own row.
    t = Tables(gen, [(400, 4), (300, 3)], [20, 30, 40, 50, 10, 60, 5], heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    rows = torch.tensor([9, 2, 5, 0, 11, 7, 3], dtype=torch.int32)
    q = make_q(gen, 12, 9, 3, 64, torch.bfloat16)
    q[rows.long()] = t.q
    plan = native.cascade_plan(t.page_table, t.seq_lens, PAGE, **ANY_SHARING)
    assert plan.plan is not None
    out = torch.full((12, 9, 64), 7.0, dtype=torch.bfloat16)
    native.paged_decode(q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, 0.125, rows=rows, out=out, plan=plan.plan)
    assert_close(out[rows.long()], reference(t.q, t.paged(), 0.125), torch.bfloat16, "mixed-step rows")
    others = [r for r in range(12) if r not in rows.tolist()]
    assert (out[others] == 7.0).all()


EXACT_CASES = [
    *CASES[:6],
    ([(200, 3), (300, 2), (1100, 4)], (9, 3), 64),  # a group under one chunk: nothing left to share
    ([(1300, 24)], (32, 4), 128),  # the 30B-A3B shape's heads: many queries a chunk, bf16 outputs that show a sum's order
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "heads", "head_dim"), EXACT_CASES)
def test_batch_invariant_groups_give_each_member_its_bits_alone(gen, dtype, groups, heads, head_dim):
    # A batch-invariant plan cuts each group's shared part to the 256-key chunk grid and runs
    # every member through the plain kernel's code: a member's output is, bit for bit, what it
    # gets decoded alone and in a batch without groups, with 1 or 2 threads, tiles on or off.
    own = torch.randint(1, 90, (sum(size for _, size in groups),), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=heads, head_dim=head_dim, dtype=dtype)
    scale = head_dim**-0.5
    plan = native.cascade_plan(t.page_table, t.seq_lens, PAGE, **ANY_SHARING)
    exact = native.batch_invariant_plan(plan, len(own))
    chunk_shared = [pages * PAGE // 256 * 256 for pages in t.shared_pages]
    assert exact.saved_tokens == sum((size - 1) * shared for (_, size), shared in zip(groups, chunk_shared, strict=True))
    assert (exact.plan is None) == (exact.saved_tokens == 0)
    assert plan.plan is None or int(plan.plan[-1]) == 0  # the planner's own plan is left as it was
    plain = native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale)
    alone = [
        native.paged_decode(t.q[b : b + 1], t.k_cache, t.v_cache, t.page_table[b : b + 1], t.seq_lens[b : b + 1], scale)[0]
        for b in range(len(own))
    ]  # fmt: skip
    assert torch.equal(torch.stack(alone), plain)
    threads = torch.get_num_threads()
    try:
        for num_threads, tiles in ((1, True), (2, True), (2, False)):
            torch.set_num_threads(num_threads)
            native.use_cascade_tiles(tiles)
            grouped = native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale, plan=exact.plan)
            assert torch.equal(grouped, plain), f"{num_threads} threads, tiles {tiles}"
    finally:
        torch.set_num_threads(threads)
        native.use_cascade_tiles(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim", "prompts"), [((32, 4), 128, [700, 300]), ((9, 3), 64, [1030]), ((6, 2), 40, [600])])
def test_prefill_rows_grouped_by_chunk_band_keep_every_rows_bits(gen, dtype, heads, head_dim, prompts):
    # A batch-invariant prefill runs every new token's row as its own request over its prefix;
    # prefill_rows_plan groups a request's rows whose keys end in the same 256-key chunk, so the
    # whole chunks before it are shared items. Each row's output stays the bits it gets alone.
    lens = [n for n in prompts for _ in range(n)]
    t = Tables(gen, [(0, len(lens))], [0] * len(lens), heads=heads, head_dim=head_dim, dtype=dtype)
    pages = -(-max(prompts) // PAGE)
    page_table = torch.zeros(len(lens), pages, dtype=torch.int32)
    request_of_row = torch.tensor([r for r, n in enumerate(prompts) for _ in range(n)])
    for r in range(len(prompts)):
        page_table[request_of_row == r] = torch.randperm(t.k_cache.shape[0], generator=gen)[:pages].to(torch.int32)
    seq_lens = torch.tensor([p + 1 for n in prompts for p in range(n)], dtype=torch.int32)
    plan = native.prefill_rows_plan(request_of_row, seq_lens)
    bands = sum((n - 1) // 256 for n in prompts)  # bands 1.. of each request: a group each
    assert plan is not None and int(plan[0]) == bands and int(plan[-1]) == 1
    scale = head_dim**-0.5
    plain = native.paged_decode(t.q, t.k_cache, t.v_cache, page_table, seq_lens, scale)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            grouped = native.paged_decode(t.q, t.k_cache, t.v_cache, page_table, seq_lens, scale, plan=plan)
            assert torch.equal(grouped, plain), f"{num_threads} threads"
    finally:
        torch.set_num_threads(threads)
    assert native.prefill_rows_plan(torch.zeros(200, dtype=torch.long), torch.arange(1, 201, dtype=torch.int32)) is None


def test_a_plan_off_the_chunk_grid_marked_exact_is_refused(gen):
    # The kernel trusts no batch-invariant mark on a group whose shared part ends inside a chunk.
    t = Tables(gen, [(300, 3)], [10, 20, 30], heads=(9, 3), head_dim=64, dtype=torch.bfloat16)
    plan = native.cascade_plan(t.page_table, t.seq_lens, PAGE, **ANY_SHARING)
    marked = plan.plan.clone()
    marked[-1] = 1
    with pytest.raises(ValueError, match="rejected"):
        native.paged_decode(t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, 0.125, plan=marked)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "head_dim"), [((9, 3), 64), ((8, 2), 48), ((4, 2), 128)])
def test_sinks_join_each_heads_softmax_in_groups_and_alone(gen, dtype, heads, head_dim):
    """gpt-oss's sink logits (one per query head) join each softmax where a request's states
    merge: plain, in cascade groups and in a batch-invariant plan the reference's output, the
    exact plan still each member's bits alone; the sinks (about the scores' size) move the output
    far past the tolerance, so a kernel that dropped them fails."""
    groups = [(600, 3), (300, 2)]
    own = torch.randint(1, 90, (5,), generator=gen).tolist()
    t = Tables(gen, groups, own, heads=heads, head_dim=head_dim, dtype=dtype)
    scale, sinks = head_dim**-0.5, torch.randn(heads[0], generator=gen) * 3 + 9  # about the largest scores
    expected = reference(t.q, t.paged(), scale, sinks=sinks)
    plan = native.cascade_plan(t.page_table, t.seq_lens, PAGE, **ANY_SHARING)
    exact = native.batch_invariant_plan(plan, len(own))
    assert plan.plan is not None and exact.plan is not None
    args = (t.q, t.k_cache, t.v_cache, t.page_table, t.seq_lens, scale)
    plain = native.paged_decode(*args, sinks=sinks)
    for what, out in (("plain", plain), ("cascade", native.paged_decode(*args, plan=plan.plan, sinks=sinks))):
        assert_close(out, expected, dtype, f"{what}, seed {gen.initial_seed()}")
    assert torch.equal(native.paged_decode(*args, plan=exact.plan, sinks=sinks), plain)
    assert (plain.double() - reference(t.q, t.paged(), scale)).abs().max() > 0.1
    with pytest.raises(ValueError, match="sinks must be"):
        native.paged_decode(*args, sinks=sinks[:-1])
