"""Prefix-cache micro-benchmark: RadixTree match / insert / evict throughput at 1k, 10k and 100k
cached blocks, and the cost of one eviction among 100k leaves next to a naive eviction that
rebuilds a heap over every evictable leaf on each call (as SGLang does), measured in one run.

    radixkv bench bench_cache [--out out/bench_cache] [--sizes 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.radix import Node

VOCAB = 32_000
PREFIX_BLOCKS = 4  # blocks of the prefix shared by a group of prompts
UNIQUE_BLOCKS = 4  # blocks of each prompt after its group prefix
PROMPTS_PER_GROUP = 16
TAIL_TOKENS = 5  # a partial block: never cached, keeps the match cap from biting


@dataclass(frozen=True, slots=True)
class Row:
    op: str
    cached_blocks: int
    ops: int
    seconds: float
    ops_per_s: float
    blocks_per_s: float


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_cache", help="folder for bench_cache.json")
    parser.add_argument("--sizes", default="1000,10000,100000", help="cached blocks, comma separated")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--leaves", type=int, default=100_000, help="leaves for the eviction comparison")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)

    rows = [bench_hashing(args.page_size, rng)]
    for size in sizes:
        rows += bench_tree(size, args.page_size, rng)
        gc.collect()
    eviction = bench_eviction_vs_naive(args.leaves, args.page_size, rng)

    print_table(rows, eviction)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "page_size": args.page_size,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": [asdict(row) for row in rows],
        "eviction_vs_naive": eviction,
    }
    (out / "bench_cache.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out / 'bench_cache.json'}")
    return 0


# --------------------------------------------------------------------------- workloads


def make_prompts(num_blocks: int, page_size: int, rng: np.random.Generator) -> list[list[int]]:
    """Groups of prompts sharing a prefix, with about `num_blocks` distinct full blocks."""
    per_group_blocks = PREFIX_BLOCKS + PROMPTS_PER_GROUP * UNIQUE_BLOCKS
    num_groups = max(1, round(num_blocks / per_group_blocks))
    prompts = []
    for _ in range(num_groups):
        prefix = rng.integers(0, VOCAB, PREFIX_BLOCKS * page_size).tolist()
        for _ in range(PROMPTS_PER_GROUP):
            prompts.append(prefix + rng.integers(0, VOCAB, UNIQUE_BLOCKS * page_size + TAIL_TOKENS).tolist())
    return prompts


def build(prompts: list[list[int]], pool: PagePool, tree: RadixTree) -> float:
    """Insert every prompt as a finished request would; returns seconds spent in insert()."""
    ps = tree.page_size
    spent = 0.0
    for tokens in prompts:
        pages = pool.allocate(len(tokens) // ps)
        start = time.perf_counter()
        result = tree.insert(tokens, pages)
        spent += time.perf_counter() - start
        pool.release(pages)  # drop the request's references: the tree keeps what it adopted
        assert result.num_existing_blocks + result.num_inserted_blocks == len(pages)
    return spent


def rate(op: str, cached_blocks: int, ops: int, blocks: int, seconds: float) -> Row:
    return Row(op, cached_blocks, ops, seconds, ops / seconds, blocks / seconds)


def bench_hashing(page_size: int, rng: np.random.Generator) -> Row:
    hasher = BlockHasher(page_size, seed=1)
    tokens = rng.integers(0, VOCAB, 4096 * page_size).tolist()
    start = time.perf_counter()
    for _ in range(5):
        hasher.hash_blocks(tokens)
    return rate("hash_blocks", 0, 5, 5 * 4096, time.perf_counter() - start)


def bench_tree(num_blocks: int, page_size: int, rng: np.random.Generator) -> list[Row]:
    prompts = make_prompts(num_blocks, page_size, rng)
    num_extend = max(200, len(prompts) // 8)
    pool = PagePool(num_blocks * 2 + num_extend * 16 + 1024, page_size)
    tree = RadixTree(pool, BlockHasher(page_size, seed=1))
    build(prompts, pool, tree)
    cached = tree.cached_pages
    rows = []

    # match: hits of whole cached prompts (the partial tail stays uncomputed), hashes computed
    # by the tree at node boundaries, then with hashes the engine precomputed per request.
    queries = [prompts[i] for i in rng.integers(0, len(prompts), 20_000)]
    start = time.perf_counter()
    hit_blocks = sum(tree.match(tokens).num_cached_tokens for tokens in queries) // page_size
    rows.append(rate("match", cached, len(queries), hit_blocks, time.perf_counter() - start))
    hashes = [tree.hasher.hash_blocks(tokens) for tokens in queries]
    start = time.perf_counter()
    for tokens, block_hashes in zip(queries, hashes):
        tree.match(tokens, block_hashes=block_hashes)
    rows.append(rate("match (precomputed hashes)", cached, len(queries), hit_blocks, time.perf_counter() - start))

    # insert: a conversation grows by one block: 8 cached blocks walked, 1 adopted.
    extended = [
        prompts[i][: -TAIL_TOKENS] + rng.integers(0, VOCAB, page_size + TAIL_TOKENS).tolist()
        for i in rng.integers(0, len(prompts), num_extend)
    ]
    pages = [pool.allocate(len(tokens) // page_size) for tokens in extended]
    start = time.perf_counter()
    for tokens, request_pages in zip(extended, pages):
        tree.insert(tokens, request_pages)
    elapsed = time.perf_counter() - start
    rows.append(rate("insert (+1 block)", cached, len(extended), sum(map(len, pages)), elapsed))
    for request_pages in pages:
        pool.release(request_pages)

    # evict: a request short of 8 pages at a time, oldest leaves first.
    num_evict = max(50, tree.cached_pages // 80)
    start = time.perf_counter()
    freed = sum(tree.evict(8) for _ in range(num_evict))
    rows.append(rate("evict(8)", tree.cached_pages + freed, num_evict, freed, time.perf_counter() - start))
    tree.check_invariants()
    return rows


def bench_eviction_vs_naive(num_leaves: int, page_size: int, rng: np.random.Generator) -> dict[str, float]:
    """One shared block with `num_leaves` one-block leaves under it; evict one leaf at a time."""
    pool = PagePool(num_leaves + 2, page_size)
    tree = RadixTree(pool, BlockHasher(page_size, seed=1))
    shared = rng.integers(0, VOCAB, page_size).tolist()
    leaves = rng.integers(0, VOCAB, (num_leaves, page_size))
    for row in leaves:
        pages = pool.allocate(2)
        tree.insert(shared + row.tolist(), pages)
        pool.release(pages)
    assert len(tree._order) == num_leaves

    ours_calls = 2000
    start = time.perf_counter()
    for _ in range(ours_calls):
        tree.evict(1)
    ours_s = (time.perf_counter() - start) / ours_calls

    naive_calls = 5
    start = time.perf_counter()
    for _ in range(naive_calls):
        naive_evict(tree, 1)
    naive_s = (time.perf_counter() - start) / naive_calls
    tree.check_invariants()
    return {
        "leaves": num_leaves,
        "sorted_lru_evict_us": ours_s * 1e6,
        "naive_heap_evict_us": naive_s * 1e6,
        "naive_over_sorted": naive_s / ours_s,
    }


def naive_evict(tree: RadixTree, num_pages: int) -> int:
    """SGLang's way: walk the tree for unlocked leaves, heapify them all, pop the oldest.
    Removal reuses the tree's own (O(log n)) bookkeeping so the tree stays consistent."""
    leaves: list[tuple[int, int, Node]] = []
    stack = [child for root in tree._roots.values() for child in root.children.values()]
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(node.children.values())
        elif node.lock_ref == 0:
            leaves.append((node.last_access, node.node_id, node))
    heapq.heapify(leaves)
    freed = 0
    while freed < num_pages and leaves:
        key = heapq.heappop(leaves)
        node = key[2]
        parent = node.parent
        tree._order.remove(node)
        freed += tree._remove_leaf(node)
        if parent is not None and parent.parent is not None and not parent.children and parent.lock_ref == 0:
            heapq.heappush(leaves, (parent.last_access, parent.node_id, parent))
    return freed


def print_table(rows: list[Row], eviction: dict[str, float]) -> None:
    print(f"{'operation':<28} {'cached blocks':>13} {'ops':>7} {'ops/s':>12} {'blocks/s':>12}")
    for row in rows:
        cached = "-" if row.op == "hash_blocks" else f"{row.cached_blocks:,}"
        print(f"{row.op:<28} {cached:>13} {row.ops:>7,} {row.ops_per_s:>12,.0f} {row.blocks_per_s:>12,.0f}")
    print(
        f"\none eviction among {eviction['leaves']:,} leaves: sorted LRU {eviction['sorted_lru_evict_us']:,.1f} us, "
        f"naive heap rebuild {eviction['naive_heap_evict_us']:,.1f} us "
        f"-> naive/sorted = {eviction['naive_over_sorted']:,.0f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
