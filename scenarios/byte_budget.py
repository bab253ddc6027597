"""trace_replay's RAM budgets in bytes: per page storage dtype (BudgetRow), and with --kv-window
a window-aware pool (cache/layer_groups.py: full layers keep every block, window layers their
own pages, a window's worth before each cut) against every layer keeping every block, at the
same bytes (WindowRow). Replays run through the real KVManager, RadixTree and WindowPages.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.kv_dtype import KV_STORAGE_DTYPES
from radixkv.cache.layer_groups import WindowPages
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SequenceState
from radixkv.engine.sampling_params import SamplingParams

# Blocks a replayed request computes a step (its window pages go back as it moves on, as under
# chunked prefill); the window pool must hold a chunk and a window (min_window_pages).
CHUNK_BLOCKS = 8
# Shares of the byte budget given to the window layers' pool, each replayed; the best is the
# row the summary names (a deployment would pick its num_window_pages likewise).
WINDOW_SHARES = (0.05, 0.1, 0.2, 0.35, 0.5)


@dataclass(frozen=True, slots=True)
class Budgets:
    budgets: list[int]
    kv_dtypes: list[str]
    shape: tuple[int, int, int]  # layers, KV heads, head dim
    block_tokens: int
    window: tuple[int, int] | None  # (window layers, W tokens)


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """One policy's replay at a RAM budget in bytes with pages stored in one kv dtype."""

    kv_dtype: str
    policy: str
    ram_bytes: int
    bytes_per_token: float  # K and V over all layers, scales included
    tokens_per_gib: int
    ram_blocks: int
    hit_ratio: float


@dataclass(frozen=True, slots=True)
class WindowRow:
    """A RAM budget replayed with every layer keeping every block, or window-aware pages."""

    kv_dtype: str
    ram_bytes: int
    layout: str  # "all-layers" or "window-aware"
    window_share: float  # of the bytes, the window layers' pool (0 for all-layers)
    full_blocks: int  # blocks the full layers (all layers, for all-layers) hold
    window_blocks: int
    hit_ratio: float


Replay = Callable[..., object]  # trace_replay.replay: (trace, policy, fraction, 0.0, blocks, 0, page_size) -> Row


def parse_budgets(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Budgets:
    kv_dtypes = [d.strip() for d in args.kv_dtype.split(",") if d.strip()]
    if set(kv_dtypes) - set(KV_STORAGE_DTYPES):
        parser.error(f"unknown --kv-dtype {sorted(set(kv_dtypes) - set(KV_STORAGE_DTYPES))}; known: {list(KV_STORAGE_DTYPES)}")
    shape = _kv_shape(args.kv_shape, parser)
    window = None
    if args.kv_window:
        try:
            count, tokens = (int(part) for part in args.kv_window.split(":"))
        except ValueError:
            parser.error(f"--kv-window takes count:W (window layers, window tokens), got {args.kv_window!r}")
        if not 1 <= count < shape[0] or tokens < 2:
            parser.error(f"--kv-window needs 1 <= count < {shape[0]} layers (--kv-shape) and W >= 2, got {args.kv_window!r}")
        window = (count, tokens)
    budgets = [_bytes(text, parser) for text in args.ram_bytes.split(",") if text.strip()]
    return Budgets(budgets, kv_dtypes, shape, args.block_tokens, window)


def budget_report(budgets: Budgets, trace, policies: list[str], page_size: int, replay: Replay) -> tuple[list[BudgetRow], list[WindowRow]]:
    rows = byte_budget_rows(trace, budgets, policies, page_size, replay)
    print()
    print_budget_table(rows)
    if budgets.window is None:
        return rows, []
    window_rows = [row for budget in budgets.budgets for name in budgets.kv_dtypes for row in window_budget_rows(trace, budgets, budget, name, page_size)]
    print()
    print_window_table(window_rows)
    return rows, window_rows


def byte_budget_rows(trace, budgets: Budgets, policies: list[str], page_size: int, replay: Replay) -> list[BudgetRow]:
    """Each budget, kv dtype and policy: the blocks the bytes hold, replayed (RAM only)."""
    layers, kv_heads, head_dim = budgets.shape
    rows = []
    for budget in budgets.budgets:
        for name in budgets.kv_dtypes:
            block_bytes = PagePool.bytes_per_page(budgets.block_tokens, layers, kv_heads, head_dim, KV_STORAGE_DTYPES[name])
            ram_blocks = max(1, budget // block_bytes)
            for policy in policies:
                row = replay(trace, policy, ram_blocks / trace.num_distinct_blocks, 0.0, ram_blocks, 0, page_size)
                rows.append(BudgetRow(
                    name, policy, budget, block_bytes / budgets.block_tokens,
                    int((1 << 30) / block_bytes * budgets.block_tokens), ram_blocks, row.hit_ratio,
                ))  # fmt: skip
    return rows


def window_budget_rows(trace, budgets: Budgets, budget: int, kv_dtype: str, page_size: int) -> list[WindowRow]:
    """All layers keeping every block, then window-aware pages at each share of WINDOW_SHARES."""
    assert budgets.window is not None
    layers, kv_heads, head_dim = budgets.shape
    count, tokens = budgets.window
    dtype, block = KV_STORAGE_DTYPES[kv_dtype], budgets.block_tokens
    all_bytes = PagePool.bytes_per_page(block, layers, kv_heads, head_dim, dtype)
    full_bytes = PagePool.bytes_per_page(block, layers - count, kv_heads, head_dim, dtype)
    window_bytes = PagePool.bytes_per_page(block, count, kv_heads, head_dim, dtype)
    # A window of W tokens before a cut spans ceil((W-1)/block) trace blocks: in the replay's
    # pages (page_size tokens a block) that is a window of that many pages' tokens.
    window_pages = -(-(tokens - 1) // block)
    least = window_pages + 1 + CHUNK_BLOCKS
    blocks = max(1, budget // all_bytes)
    rows = [WindowRow(kv_dtype, budget, "all-layers", 0.0, blocks, 0, replay_window_aware(trace, blocks, None, page_size))]
    for share in WINDOW_SHARES:
        num_window = max(least, int(budget * share) // window_bytes)
        num_full = max(1, (budget - num_window * window_bytes) // full_bytes)
        windows = WindowPages(PagePool(num_window, page_size), window_pages * page_size)
        rows.append(WindowRow(kv_dtype, budget, "window-aware", share, num_full, num_window, replay_window_aware(trace, num_full, windows, page_size)))
    return rows


def replay_window_aware(trace, num_full_blocks: int, windows: WindowPages | None, page_size: int) -> float:
    """Prefix-hit ratio (blocks) of the trace in trace order, RAM only, slru, each request
    computed CHUNK_BLOCKS blocks a step and committed after each as the engine does."""
    from radixkv.scenarios.trace_replay import block_tokens  # the replay's token runs per hash id

    pool = PagePool(num_full_blocks + 1, page_size)  # + the one-token tail's page
    hasher = BlockHasher(page_size, seed=0)
    tree = RadixTree(pool, hasher, eviction_policy="slru")
    kv = KVManager(pool, tree, hasher, True, windows=windows)
    params, hits, chunk = SamplingParams(max_tokens=1), 0, CHUNK_BLOCKS * page_size
    for number, hash_ids in enumerate(trace.requests):
        seq = SequenceState(number, f"r{number}", 0, [t for h in hash_ids for t in block_tokens(h, page_size)] + [0], params, None, 0)
        peek = kv.peek(seq)
        num_new = min(chunk, seq.num_tokens - peek.num_cached_tokens)
        if not kv.can_admit(peek, num_new):
            continue  # larger than RAM: computed without the cache
        hits += kv.admit(seq, num_new).num_cached_tokens // page_size
        while True:
            seq.num_computed_tokens += num_new
            kv.commit(seq)
            num_new = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if not num_new or kv.reserve(seq, num_new) is None:
                break
        kv.release(seq)
    return hits / trace.num_blocks


def print_budget_table(rows: list[BudgetRow]) -> None:
    columns = (("kv_dtype", "<9", ""), ("policy", "<7", ""), ("RAM bytes", ">13", ","), ("B/token", ">8", ".0f"),
               ("tokens/GiB", ">11", ","), ("RAM blocks", ">10", ","), ("hit all", ">8", ".3f"))  # fmt: skip
    _print_table(columns, [(r.kv_dtype, r.policy, r.ram_bytes, r.bytes_per_token, r.tokens_per_gib, r.ram_blocks, r.hit_ratio) for r in rows])


def print_window_table(rows: list[WindowRow]) -> None:
    columns = (("kv_dtype", "<9", ""), ("RAM bytes", ">15", ","), ("layout", "<13", ""), ("share", ">6", ".2f"),
               ("full blocks", ">11", ","), ("window blocks", ">13", ","), ("hit", ">6", ".3f"))  # fmt: skip
    _print_table(columns, [(r.kv_dtype, r.ram_bytes, r.layout, r.window_share, r.full_blocks, r.window_blocks, r.hit_ratio) for r in rows])


def _print_table(columns: tuple[tuple[str, str, str], ...], cells: list[tuple]) -> None:
    """A fixed-width table: each column's (header, alignment and width, value format)."""
    header = " ".join(f"{name:{width}}" for name, width, _ in columns)
    print(header)
    print("-" * len(header))
    for row in cells:
        print(" ".join(f"{value:{width}{spec}}" for value, (_, width, spec) in zip(row, columns, strict=True)))


def _bytes(text: str, parser: argparse.ArgumentParser) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        parser.error(f"--ram-bytes takes sizes like 512M or 2G, got {text!r}")
    if value <= 0:
        parser.error(f"--ram-bytes must be positive, got {text!r}")
    return value


def _kv_shape(text: str, parser: argparse.ArgumentParser) -> tuple[int, int, int]:
    try:
        layers, kv_heads, head_dim = (int(part) for part in text.split(","))
    except ValueError:
        parser.error(f"--kv-shape takes layers,kv_heads,head_dim, got {text!r}")
    if min(layers, kv_heads, head_dim) < 1:
        parser.error(f"--kv-shape values must be >= 1, got {text!r}")
    return layers, kv_heads, head_dim
