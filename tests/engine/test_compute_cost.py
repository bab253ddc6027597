"""The engine's compute-cost fit: it recovers a per-token and a per-attended-position cost from
steps that mix them, falls back to the mean where steps cannot tell them apart, and makes the
disk tier read a deep run that computing would cost more than reading, and compute a shallow
one of the same length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.disk import DiskTier
from radixkv.engine.compute_cost import ComputeCost, attended
from radixkv.engine.kv_manager import KVManager


def test_attended_positions_sum_each_tokens_context() -> None:
    assert attended(0, 1) == 1 and attended(0, 3) == 1 + 2 + 3 and attended(10, 2) == 11 + 12


def test_the_fit_recovers_both_costs() -> None:
    cost = ComputeCost()
    assert cost.estimate_s(0, 16) is None  # nothing measured: the disk is tried
    per_token, per_attended = 2e-4, 1e-7
    for start, num in ((0, 512), (1024, 64), (4096, 8), (0, 128), (2048, 256)):
        cost.observe(num, attended(start, num), per_token * num + per_attended * attended(start, num))
    fit = cost.coefficients()
    assert fit == pytest.approx((per_token, per_attended), rel=1e-6)
    assert cost.estimate_s(4000, 160) == pytest.approx(per_token * 160 + per_attended * attended(4000, 160))


def test_steps_that_cannot_tell_the_costs_apart_give_the_mean() -> None:
    cost = ComputeCost()
    for _ in range(4):
        cost.observe(100, attended(0, 100), 0.5)  # every step alike
    assert cost.coefficients() == pytest.approx((0.005, 0.0))


def test_a_deep_run_is_read_and_a_shallow_one_computed(tmp_path: Path) -> None:
    pool = PagePool(8, 4, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    tree = RadixTree(pool, BlockHasher(4, seed=0))
    disk = DiskTier(tmp_path / "kv", 1 << 20, fingerprint="m", page_size=4, payload_bytes=pool.page_nbytes)
    cost = ComputeCost()
    for start, num in ((0, 256), (4096, 16), (1024, 64)):
        cost.observe(num, attended(start, num), 1e-4 * num + 1e-7 * attended(start, num))
    kv = KVManager(pool, tree, tree.hasher, True, disk, cost.estimate_s)
    disk.read_s_per_block = 4 * 1e-4 * 2  # a block reads in the time 8 tokens compute at position 0
    loader = kv.cache_view().loader
    assert loader is not None
    assert not loader.pays(0, 4)  # near the start computing is cheaper
    assert loader.pays(20000 // 4, 4)  # deep in a long prompt attention makes it dearer
    assert disk.counters["computed_instead"] == 1
