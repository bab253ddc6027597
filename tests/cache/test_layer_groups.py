"""Layer groups at the KV manager, without a model: two groups (full layers, a window of W
tokens) under random admissions, steps, commits, releases and evictions keep each pool's
accounting exact (free + evictable + in use == total, every refcount explained), the tree
consistent, and a match never stops where a window lacks its pages."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.cache.layer_groups import LayerGroups, WindowPages
from radixkv.cache.radix_check import check_tree
from radixkv.engine.invariants import check_page_accounting
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SequenceState
from radixkv.engine.sampling_params import SamplingParams

PAGE, WINDOW = 4, 9  # a window spanning parts of three pages
_ids = itertools.count()


def make_kv(num_pages: int, num_window_pages: int) -> tuple[KVManager, PagePool, RadixTree, WindowPages]:
    pool = PagePool(num_pages, PAGE, num_layers=1, num_kv_heads=1, head_dim=2)
    windows = WindowPages(PagePool(num_window_pages, PAGE, num_layers=2, num_kv_heads=1, head_dim=2), WINDOW)
    tree = RadixTree(pool, BlockHasher(PAGE, seed=0))
    return KVManager(pool, tree, tree.hasher, True, windows=windows), pool, tree, windows


def make_seq(tokens: list[int]) -> SequenceState:
    seq_id = next(_ids)
    return SequenceState(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=4), None, 0)


def path_pages(node) -> list[int]:
    runs = []
    while node is not None and node.parent is not None:
        runs.append(node.pages)
        node = node.parent
    return [page for run in reversed(runs) for page in run]


def unlocked_leaves(tree: RadixTree) -> list:
    return [node for node in tree.iter_nodes() if node.parent is not None and not node.children and node.lock_ref == 0]


def end_usable(node, windows: WindowPages) -> bool:
    """A hit at the node's end would be taken whole: the window before it still has pages."""
    pages = path_pages(node)
    return windows.usable_tokens(pages, len(pages) * PAGE) == len(pages) * PAGE


def test_groups_from_layer_windows() -> None:
    groups = LayerGroups((512, 512, None, 512), 4)
    assert groups.grouped and groups.full_layers == (2,) and groups.window_layers == (0, 1, 3) and groups.window == 512
    assert groups.per_layer(["f"], ["a", "b", "c"]) == ["a", "b", "f", "c"]
    assert not LayerGroups((), 3).grouped, "a dense model is one group"
    assert not LayerGroups((64, 64), 2).grouped, "a window on every layer is one group (it only masks)"


def test_a_sequence_keeps_only_its_window() -> None:
    kv, pool, tree, windows = make_kv(64, 16)
    seq = make_seq(list(range(200)))
    assert kv.admit(seq, 8) is not None
    for _ in range(40):  # 8 tokens a step, committed like the engine does
        seq.num_computed_tokens += 8
        kv.commit(seq)
        if seq.num_computed_tokens >= 160:
            break
        assert kv.reserve(seq, 8) is not None
        held = sum(1 for page in seq.window_table if page >= 0)
        assert held <= -(-(WINDOW - 1) // PAGE) + 1 + 2, "blocks behind the window went back"
    kv.release(seq)
    assert windows.pool.num_free + windows.evictable_pages == windows.pool.num_pages
    check_page_accounting(pool, tree, [], [], windows)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=40))
def test_accounting_holds_under_random_use(ops: list[tuple[int, int, int]]) -> None:
    kv, pool, tree, windows = make_kv(40, 14)
    prefixes = [list(range(100, 140)), list(range(100, 120)) + list(range(300, 320)), list(range(500, 540))]
    running: list[SequenceState] = []
    pins: list = []
    # retention id -> (its cut was a full hit when made, the kept-tier drops until then)
    whole_at_start: dict[int, tuple[bool, int]] = {}
    for op, which, amount in ops:
        if op == 0 or not running:  # admit a prompt sharing a prefix with others
            seq = make_seq(prefixes[which % 3][: 10 + amount % 30] + [7, 8, 9])
            peek = kv.peek(seq)
            # What a match covers, the window groups still hold: its last window has pages.
            assert peek.num_cached_tokens == windows.usable_tokens(peek.pages, peek.num_cached_tokens)
            num_new = min(seq.num_tokens - peek.num_cached_tokens, 8)
            if kv.can_admit(peek, num_new):
                kv.admit(seq, num_new)
                seq.num_computed_tokens += num_new
                kv.commit(seq)
                running.append(seq)
        elif op in (1, 2):  # a step of one running sequence
            seq = running[which % len(running)]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, 1 + amount % 8)
            if num_new and kv.reserve(seq, num_new) is not None:
                seq.num_computed_tokens += num_new
                kv.commit(seq)
            elif not num_new:
                kv.release(running.pop(which % len(running)))
        elif op == 3:  # finish one
            kv.release(running.pop(which % len(running)))
        elif op == 5:  # pin a cached prefix, or unpin the oldest pin
            if pins and amount % 2:
                kv.unpin(pins.pop(0))
            else:
                pins.append(kv.pin(prefixes[which % 3][: amount], None)[0])
        elif op == 4 and which == 3:  # retain a cached prefix, as a Keep ttl or a session's turn does
            if kv.retain(prefixes[amount % 3][:amount], None, 30.0, f"owner{amount % 2}", 12):
                retention = tree.retentions(f"owner{amount % 2}")[-1]
                whole_at_start[retention.retention_id] = (end_usable(retention.node, windows), windows.num_kept_drops)
        else:  # pressure: evict from each group
            tree.evict(amount % 5)
            bare = {node.node_id for node in tree.iter_nodes() if node.parent is not None and not end_usable(node, windows)}
            drops = windows.num_end_drops
            windows.evict(amount % 5)
            if windows.num_end_drops == drops:  # no window before a node's end dropped: every usable end stays
                assert all(end_usable(node, windows) for node in unlocked_leaves(tree) if node.node_id not in bare)
            # A retained cut that was a full hit stays one (or went whole) while no kept window
            # page was dropped, here or by an allocation under pressure since it was made.
            live = [r for owner in tree.retention_owners() for r in tree.retentions(owner)]
            untouched = [r for r in live if whole_at_start.get(r.retention_id, (False, 0)) == (True, windows.num_kept_drops)]
            assert all(r.node.removed or end_usable(r.node, windows) for r in untouched)
        check_page_accounting(pool, tree, running, [], windows)
        check_tree(tree)
    for seq in running:
        kv.release(seq)
    for node in pins:
        kv.unpin(node)
    check_page_accounting(pool, tree, [], [], windows)
    assert windows.pool.num_free + windows.evictable_pages == windows.pool.num_pages


def test_a_pinned_prefix_keeps_its_last_window() -> None:
    """Pins lock the full blocks and hold the window pages before the pinned cut: window
    eviction cannot cut a pinned prefix short; once unpinned it can."""
    kv, pool, tree, windows = make_kv(64, 16)
    prompt = list(range(300, 341))  # 10 full blocks and a token
    seq = make_seq(prompt)
    kv.admit(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    kv.commit(seq)
    kv.release(seq)
    node, pinned = kv.pin(prompt[:40], None)
    assert pinned == 40
    windows.evict(windows.pool.num_pages)
    check_page_accounting(pool, tree, [], [], windows)
    assert kv.peek(make_seq(prompt)).num_cached_tokens == 40, "the pinned window stayed"
    kv.unpin(node)
    windows.evict(windows.pool.num_pages)
    assert kv.peek(make_seq(prompt)).num_cached_tokens == 0, "unpinned, its window pages went"
    assert windows.pool.num_free == windows.pool.num_pages
    check_page_accounting(pool, tree, [], [], windows)


def test_a_retained_cut_keeps_its_window_last() -> None:
    """A retention keeps the window pages of the W tokens before its cut: window eviction takes
    every other window page first, so the retained prefix stays a hit at its cut; once the
    retention ends those pages are ordinary again."""
    kv, pool, tree, windows = make_kv(64, 24)
    clock = [0.0]
    tree._now_s = lambda: clock[0]  # the tree's clock, so the retention can end
    kept_prompt, other = list(range(300, 341)), list(range(600, 641))
    for prompt in (kept_prompt, other):
        seq = make_seq(prompt)
        kv.admit(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        kv.commit(seq)
        kv.release(seq)
    assert kv.retain(kept_prompt[:40], None, 10.0, "a", 64) == 40
    held = windows.kept_pages()
    assert held == -(-(WINDOW - 1) // PAGE), "the W tokens before the cut"
    windows.evict(windows.evictable_pages - held)
    check_page_accounting(pool, tree, [], [], windows)
    assert kv.peek(make_seq(kept_prompt)).num_cached_tokens == 40, "the retained cut is still a full hit"
    assert kv.peek(make_seq(other)).num_cached_tokens < 40, "the other prefix lost its window"
    clock[0] = 11.0
    tree.expire()
    assert windows.kept_pages() == 0
    windows.evict(1)
    assert kv.peek(make_seq(kept_prompt)).num_cached_tokens < 40, "expired, its window pages go like any"
    check_page_accounting(pool, tree, [], [], windows)


def test_retained_cuts_go_earliest_expiry_first_and_a_released_one_before_them() -> None:
    """The last tier goes by the latest live expiry among a page's retentions: the cut that
    ends sooner loses its window first; released early, a cut's pages are kept no more and
    go before every live one's."""
    kv, pool, tree, windows = make_kv(64, 36)
    clock = [0.0]
    tree._now_s = lambda: clock[0]
    prompts = [list(range(base, base + 41)) for base in (300, 600, 900)]
    for prompt in prompts:
        seq = make_seq(prompt)
        kv.admit(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        kv.commit(seq)
        kv.release(seq)
    # Expiries against the order the prompts were let go in, so the order is the expiries'.
    ttls = (30.0, 20.0, 10.0)
    for owner, (prompt, ttl) in enumerate(zip(prompts, ttls)):  # owners apart: none supersedes another
        assert kv.retain(prompt[:40], None, ttl, f"owner{owner}", 64) == 40
    assert windows.kept_pages() == 3 * -(-(WINDOW - 1) // PAGE)
    windows.evict(windows.evictable_pages - windows.kept_pages())
    whole = lambda prompt: kv.peek(make_seq(prompt)).num_cached_tokens == 40  # noqa: E731
    assert all(whole(prompt) for prompt in prompts), "every retained cut outlasts the rest"
    windows.evict(1)
    assert [whole(prompt) for prompt in prompts] == [True, True, False], "the cut ending soonest went first"
    tree.release(tree.retentions("owner0")[0].retention_id)
    windows.evict(1)
    assert [whole(prompt) for prompt in prompts] == [False, True, False], "released, its cut went before a live one"
    check_page_accounting(pool, tree, [], [], windows)


def test_a_leaf_whose_end_lost_its_window_goes_first() -> None:
    """One order over both pools: a leaf whose end lost its window KV serves no hit there, so
    the full pool gives it up before a live leaf it would otherwise keep (LRU or slru)."""
    kv, pool, tree, windows = make_kv(64, 24)
    live, bare = list(range(300, 341)), list(range(600, 641))
    for prompt in (live, bare):
        seq = make_seq(prompt)
        kv.admit(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        kv.commit(seq)
        kv.release(seq)
    holder = make_seq(live)
    kv.admit(holder, 1)  # holds the window before the live prefix's end
    windows.evict(windows.evictable_pages)  # every other window page, the bare prefix's end included
    kv.release(holder)
    tree.match(bare[:40] + [0], record=False)  # used last: by recency alone the live one would go
    check_page_accounting(pool, tree, [], [], windows)
    tree.evict(1)
    assert kv.peek(make_seq(live)).num_cached_tokens == 40, "the live prefix stayed, a full hit"
    assert tree.peek(bare[:40] + [0]).num_cached_tokens == 0, "the leaf without its end's window went first"
    check_page_accounting(pool, tree, [], [], windows)
