"""Tests for PagePool: allocation, refcounts, the free list, OutOfPages, KV tensor shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache.pages import ZERO_CHUNK_PAGES, OutOfPages, PagePool
from tests.helpers.pool import allocate_checked


def test_allocate_gives_distinct_pages_with_refcount_one() -> None:
    pool = PagePool(8, 4)
    pages = pool.allocate(5)
    assert pages == [0, 1, 2, 3, 4]
    assert len(set(pages)) == 5
    assert all(pool.refcount(page) == 1 for page in pages)
    assert pool.num_free == 3
    assert pool.free_pages() == {5, 6, 7}
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_a_page_is_zero_before_its_first_use_and_zeroing_stays_lazy() -> None:
    # Attention reads unwritten slots under a mask (0 * NaN = NaN): every page handed out must
    # be zero whatever its memory held. Zeroing runs in chunks, never far past what is in use.
    num_pages = 3 * ZERO_CHUNK_PAGES + 5
    pool = PagePool(num_pages, 2, num_layers=2, num_kv_heads=1, head_dim=4)
    for cache in (*pool.k_cache, *pool.v_cache):
        cache.fill_(float("nan"))
    taken: list[int] = []
    for n in (1, 1, ZERO_CHUNK_PAGES, 3, 2 * ZERO_CHUNK_PAGES):
        taken += pool.allocate(n)
        for cache in (*pool.k_cache, *pool.v_cache):
            assert torch.equal(cache[taken], torch.zeros_like(cache[taken]))
            clean = ~cache.flatten(1).isnan().any(dim=1)
            zeroed = int(clean.sum())
            assert clean[:zeroed].all()  # the zeroed pages are the lowest ones
            assert max(taken) < zeroed < max(taken) + 1 + ZERO_CHUNK_PAGES
    assert pool.num_free == 0


def test_out_of_pages_names_the_limits_and_allocates_nothing() -> None:
    pool = PagePool(4, 2)
    pool.allocate(3)
    with pytest.raises(OutOfPages, match="requested 2 KV pages but only 1 of 4 are free") as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.num_free, info.value.num_pages) == (2, 1, 4)
    assert pool.num_free == 1
    pool.check_invariants()


def test_release_frees_at_zero_only() -> None:
    pool = PagePool(4, 2)
    a, b = pool.allocate(2)
    pool.incref([a])
    assert pool.refcount(a) == 2
    assert pool.release([a, b]) == 1  # b freed, a still held once
    assert pool.free_pages() == {b, 2, 3}
    assert pool.release([a]) == 1
    assert pool.num_free == 4
    pool.check_invariants()


def test_double_release_and_free_incref_are_refused() -> None:
    pool = PagePool(4, 2)
    (page,) = pool.allocate(1)
    pool.release([page])
    with pytest.raises(RuntimeError, match="already free|is free"):
        pool.release([page])
    with pytest.raises(AssertionError):
        pool.incref([page])
    with pytest.raises(RuntimeError):
        pool.release([-1])
    pool.check_invariants()


def test_reset_frees_everything() -> None:
    pool = PagePool(6, 2)
    pool.incref(pool.allocate(4))
    pool.reset()
    assert pool.num_free == 6 and all(pool.refcount(p) == 0 for p in range(6))
    assert pool.allocate(6) == list(range(6))


def test_kv_tensors() -> None:
    pool = PagePool(5, 4, num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float16)
    assert len(pool.k_cache) == len(pool.v_cache) == 2
    assert pool.k_cache[0].shape == (5, 4, 3, 8) and pool.k_cache[0].dtype == torch.float16
    assert pool.k_cache[0].data_ptr() != pool.v_cache[0].data_ptr()
    assert PagePool(5, 4).k_cache == [] and PagePool(5, 4).v_cache == []
    assert PagePool.bytes_per_page(4, 2, 3, 8, torch.float16) == 2 * 2 * 4 * 3 * 8 * 2
    total = sum(t.numel() * t.element_size() for t in pool.k_cache + pool.v_cache)
    assert total == 5 * PagePool.bytes_per_page(4, 2, 3, 8, torch.float16)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_pages": 0, "page_size": 4}, "num_pages"),
        ({"num_pages": 4, "page_size": 0}, "page_size"),
        ({"num_pages": 4, "page_size": 4, "num_layers": -1}, "num_layers"),
        ({"num_pages": 4, "page_size": 4, "head_dim": 0}, "head_dim"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PagePool(**kwargs)
    with pytest.raises(ValueError, match="allocate"):
        PagePool(4, 4).allocate(-1)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/incref/release against a dict of refcounts."""

    @initialize(num_pages=st.integers(1, 12))
    def setup(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages, 2)
        self.held: list[int] = []  # one entry per reference we hold

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        self.held += allocate_checked(self.pool, n) or []

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def incref(self, i: int) -> None:
        page = self.held[i % len(self.held)]
        self.pool.incref([page])
        self.held.append(page)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        page = self.held.pop(i % len(self.held))
        freed = self.pool.release([page])
        assert freed == (0 if page in self.held else 1)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == self.held.count(page)
        assert self.pool.num_free == self.pool.num_pages - len(set(self.held))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pages_round_trip_through_bytes_page_by_page_and_gathered(dtype: torch.dtype) -> None:
    """What page_bytes gives (int8: the scales too), load_pages puts back bit for bit, by the
    CPU's page-by-page copy and by the gathered copy devices use (run here on the CPU)."""
    source = PagePool(6, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    assert len(source.k_scales) == len(source.v_scales) == (3 if dtype == torch.int8 else 0)
    generator = torch.Generator().manual_seed(0)
    for cache in source._tensors():
        cache.copy_((torch.randn(cache.shape, generator=generator) * 50).to(cache.dtype))
    payloads = [source.page_bytes(page) for page in (4, 1, 2)]
    assert len(payloads[0]) == source.page_nbytes == PagePool.bytes_per_page(4, 3, 2, 8, dtype)
    for load in ("load_pages", "_load_pages_gathered"):
        target = PagePool(6, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
        for cache in target._tensors():
            cache.zero_()
        getattr(target, load)([0, 5, 3], payloads)
        for mine, theirs in zip(target._tensors(), source._tensors(), strict=True):
            assert torch.equal(mine[[0, 5, 3]], theirs[[4, 1, 2]]) and not mine[[1, 2, 4]].any()
    with pytest.raises(ValueError):
        target.load_pages([0], [payloads[0][:-1]])


def test_pages_for_memory_takes_the_fraction_and_stays_within_one_and_the_cap() -> None:
    page_bytes = PagePool.bytes_per_page(16, 2, 4, 8, torch.float16)
    assert page_bytes == 2 * 2 * 16 * 4 * 8 * 2
    sized = PagePool.pages_for_memory(100 * page_bytes, 0.5, 1000, 16, 2, 4, 8, torch.float16)
    assert sized == 50
    assert PagePool.pages_for_memory(100 * page_bytes, 0.5, 7, 16, 2, 4, 8, torch.float16) == 7
    assert PagePool.pages_for_memory(page_bytes // 2, 0.9, 1000, 16, 2, 4, 8, torch.float16) == 1


def test_page_bytes_count_the_storage_dtype_and_int8_scales() -> None:
    """Pages are sized in their storage bytes: int8 pages are head_dim int8 plus one fp16 scale
    per (token, kv head), so a budget holds 2 * 64 / 66 times the bf16 pages at head_dim 64."""
    bf16 = PagePool.bytes_per_page(16, 2, 4, 64, torch.bfloat16)
    int8 = PagePool.bytes_per_page(16, 2, 4, 64, torch.int8)
    assert int8 == 2 * 2 * 16 * 4 * (64 + 2)
    budget = 1000 * bf16
    ratio = PagePool.pages_for_memory(budget, 1.0, 1 << 20, 16, 2, 4, 64, torch.int8) / 1000
    assert ratio == pytest.approx(2 * 64 / 66, abs=1e-3)
    pool = PagePool(3, 16, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.int8)
    assert pool.page_nbytes == int8 and pool.dtype == torch.int8
    assert pool.k_scales[0].shape == (3, 16, 4) and pool.k_scales[0].dtype == torch.float16
    pool.allocate(1)
    assert not pool.k_scales[1][0].any()  # zeroed with its page


def test_available_memory_is_positive_on_the_host() -> None:
    from radixkv.cache.pages import available_memory_bytes

    assert available_memory_bytes(torch.device("cpu")) > 0
