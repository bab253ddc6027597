"""Prefill attention on CPU (radixkv/cpu/csrc/paged_extend.c): each request's new tokens over its
paged KV, causally, held to the float64 reference of tests/helpers/paged.py (each new token is a decode
query over the keys up to its own position) at the same tolerances.

Lengths straddle the kernel's 64-token query blocks and 256-token key chunks, and page size 7
makes key blocks cross pages; slots no request owns hold a huge value, so reading past a
request's keys (or a later token's key, against the causal mask) gives outputs far off.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.helpers.paged import Paged, assert_close, gen, make_paged, make_q, reference  # noqa: F401  (gen is a fixture)

from radixkv.cpu import decode, extend

DTYPES = [torch.float32, torch.bfloat16]
# (num_q_heads, num_kv_heads): GQA groups 1, 3 and 8.
HEADS = {"group1": (2, 2), "group3": (6, 2), "group8": (8, 1)}
# (cached prefix, new tokens) per request: one token, a block and one more, a chunk edge, a long prompt.
REQUESTS = [(0, 1), (0, 17), (37, 64), (255, 65), (0, 300), (600, 130), (1000, 5)]


def kernel_runs(dtype: torch.dtype, head_dim: int, group: int) -> None:
    if not extend.fits(dtype, head_dim, group):
        feature = "avx512_bf16" if dtype == torch.bfloat16 else "avx2 and fma"
        pytest.skip(f"the prefill kernel does not take {dtype} head_dim {head_dim} on this CPU: it needs {feature}")


def run_case(gen, requests, heads, head_dim, page_size, dtype, order=None):
    """The kernel's output rows for these requests (rows laid out in `order`, default in turn),
    and the reference for them; rows of no request keep their sentinel."""
    num_q_heads, num_kv_heads = heads
    seq_lens = [prefix + new for prefix, new in requests]
    paged = make_paged(gen, seq_lens, num_kv_heads, head_dim, page_size, dtype)
    # q drawn for the requests in turn, then laid out in `order`: a request's rows hold the
    # same values wherever they sit. Row 0 belongs to no request.
    drawn = make_q(gen, 1 + sum(new for _, new in requests), num_q_heads, num_kv_heads, head_dim, dtype)
    q = make_q(gen, drawn.shape[0], num_q_heads, num_kv_heads, head_dim, dtype)
    starts, row, at = [0] * len(requests), 1, [1]
    for _, new in requests:
        at.append(at[-1] + new)
    for b in order or range(len(requests)):
        starts[b], row = row, row + requests[b][1]
        q[starts[b] : row] = drawn[at[b] : at[b + 1]]
    out = torch.full(q.shape, 7.0, dtype=dtype)
    q_starts = torch.tensor(starts, dtype=torch.int32)
    q_lens = torch.tensor([new for _, new in requests], dtype=torch.int32)
    decode.check_tables(paged.page_table, paged.seq_lens, q_starts, q.shape[0], paged.k_cache.shape[0], page_size)
    extend.check_rows(q_starts, q_lens, paged.seq_lens, q.shape[0])
    scale = head_dim**-0.5
    extend.paged_extend(q, paged.k_cache, paged.v_cache, paged.page_table, paged.seq_lens, q_starts, q_lens, scale, out)
    # Each new token as a decode query over the keys up to its own position.
    tables, lens, rows = [], [], []
    for b, (prefix, new) in enumerate(requests):
        for t in range(new):
            tables.append(paged.page_table[b])
            lens.append(prefix + t + 1)
            rows.append(starts[b] + t)
    expanded = Paged(paged.k_cache, paged.v_cache, torch.stack(tables), torch.tensor(lens, dtype=torch.int32), page_size)
    return out, rows, reference(q, expanded, scale, rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (128, 7), (96, 16), (256, 16)])
def test_paged_extend_matches_reference(gen, dtype, heads, head_dim, page_size) -> None:
    kernel_runs(dtype, head_dim, heads[0] // heads[1])
    out, rows, expected = run_case(gen, REQUESTS, heads, head_dim, page_size, dtype)
    assert_close(out[rows], expected, dtype, f"{dtype} {heads} head_dim {head_dim} page {page_size}")
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all()), "rows of no request were written"


@pytest.mark.parametrize("head_dim", [40, 48])  # 5 and 6 vectors of 8 floats: p.v's narrower passes on AVX2
def test_paged_extend_in_float32_at_head_dims_of_8_lane_vectors(gen, head_dim) -> None:
    if not extend.fits(torch.float32, head_dim, 3):
        pytest.skip(f"float32 head_dim {head_dim} runs on the AVX2 kernel, built where avx512f is missing; AVX-512 takes multiples of 16")
    out, rows, expected = run_case(gen, REQUESTS, HEADS["group3"], head_dim, 16, torch.float32)
    assert_close(out[rows], expected, torch.float32, f"float32 head_dim {head_dim}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_in_any_order_and_thread_count_give_the_same_bits(gen, dtype) -> None:
    kernel_runs(dtype, 64, 3)
    state = gen.get_state()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, rows_one, _ = run_case(gen, REQUESTS, HEADS["group3"], 64, 16, dtype)
        torch.set_num_threads(max(2, threads))
        gen.set_state(state)
        many, rows_many, _ = run_case(gen, REQUESTS, HEADS["group3"], 64, 16, dtype, order=[6, 2, 0, 5, 1, 4, 3])
    finally:
        torch.set_num_threads(threads)
    # Same requests and inputs; a request's rows sit elsewhere, its bits do not change.
    per_request_one = [one[rows_one[i]] for i in range(len(rows_one))]
    per_request_many = [many[rows_many[i]] for i in range(len(rows_many))]
    assert all(torch.equal(a, b) for a, b in zip(per_request_one, per_request_many))


def test_shapes_the_kernel_does_not_take_are_refused() -> None:
    assert not extend.fits(torch.float16, 64, 1)
    assert not extend.fits(torch.bfloat16, 40, 1)  # not a multiple of 32
    assert not extend.fits(torch.float32, 64, 17)  # a GQA group past the kernel's limit


def test_rows_outside_q_or_longer_than_the_sequence_are_refused() -> None:
    lens = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(IndexError, match="outside"):
        extend.check_rows(torch.tensor([0, 15], dtype=torch.int32), torch.tensor([10, 10], dtype=torch.int32), lens, 24)
    with pytest.raises(ValueError, match="1 to seq_len"):
        extend.check_rows(torch.tensor([0, 11], dtype=torch.int32), torch.tensor([11, 10], dtype=torch.int32), lens, 30)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=13, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 140)), min_size=1, max_size=4),
    group=st.sampled_from([1, 3, 8]),
    page_size=st.sampled_from([1, 5, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_extend_matches_reference_property(dtype, requests, group, page_size, seed) -> None:
    kernel_runs(dtype, 64, group)
    out, rows, expected = run_case(torch.Generator().manual_seed(seed), requests, (group, 1), 64, page_size, dtype)
    assert_close(out[rows], expected, dtype, f"seed {seed}")
