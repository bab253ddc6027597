"""The prefix cache's invariant checker: walks a RadixTree and raises AssertionError unless
its counters, eviction order, retentions and page references agree with its structure. Slow
(O(nodes)); tests and EngineConfig.check_invariants call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixkv.cache.eviction import Liveness

if TYPE_CHECKING:
    from radixkv.cache.hashing import BlockHash
    from radixkv.cache.radix import RadixTree
    from radixkv.cache.radix_node import Node


def check_tree(tree: RadixTree, *, check_hashes: bool = False) -> None:
    """Raise AssertionError unless the tree is consistent with itself and with the pool.
    `check_hashes` also recomputes every block hash from the tokens."""
    walk = _Walk()
    for salt, root in tree._roots.items():
        _require(root.parent is None and root.salt == salt, f"root of salt {salt!r} is malformed")
        _require(not root.pages and not root.tokens and not root.hashes, f"root of salt {salt!r} holds blocks")
        _check_subtree(tree, root, walk)
        if check_hashes:
            _check_subtree_hashes(tree, root)
    _require(walk.cached == tree._cached_pages, f"cached_pages {tree._cached_pages} != walk {walk.cached}")
    _require(
        walk.evictable == tree._evictable_pages,
        f"evictable_pages {tree._evictable_pages} != walk {walk.evictable}",
    )
    _require(walk.nodes == tree._num_nodes, f"num_nodes {tree._num_nodes} != walk {walk.nodes}")
    _require(
        walk.retained == tree.retained_pages, f"retained_pages {tree.retained_pages} != walk {walk.retained}"
    )
    cap = tree.max_retained_pages
    _require(cap is None or walk.retained <= cap, f"{walk.retained} retained pages, over the cap of {cap}")
    _require(
        walk.protected == tree._protected_pages,
        f"protected_pages {tree._protected_pages} != walk {walk.protected}",
    )
    _check_order(tree, walk)
    _check_book(tree, walk)


def _check_order(tree: RadixTree, walk: _Walk) -> None:
    """The eviction order holds exactly the unlocked leaves, each under its current key."""
    keys = tree._order.keys()
    for tag, value, node_id, node in keys:
        expected = tree._order.key_of(node)
        if (tag, value, node_id) != expected[:3]:
            _fail(f"stale eviction key for {node!r}")
        if node.evict_key != (tag, value, node_id, node):
            _fail(f"{node!r} forgot its eviction key")
    ids = [key[2] for key in keys]
    _require(len(ids) == len(set(ids)), "a node is in the eviction order twice")
    _require(
        set(ids) == walk.unlocked_leaves,
        f"eviction order != unlocked leaves: extra {sorted(set(ids) - walk.unlocked_leaves)[:8]}, "
        f"missing {sorted(walk.unlocked_leaves - set(ids))[:8]}",
    )


def _check_book(tree: RadixTree, walk: _Walk) -> None:
    """Every retention id in the tree is live with the same expiry, and a live retention
    marks every still-cached node of its path."""
    for retention_id, expires_at_s in walk.retention_ids.items():
        retention = tree._book.get(retention_id)
        _require(retention is not None, f"retention {retention_id} is marked in the tree but not live")
        _require(retention.expires_at_s == expires_at_s, f"retention {retention_id} is marked with another expiry")
    for retention in tree._book:
        node: Node | None = retention.node
        while node is not None and node.parent is not None:
            if not node.removed and retention.retention_id not in node.retains:
                _fail(f"retention {retention.retention_id} misses {node!r}")
            node = node.parent


def _check_subtree(tree: RadixTree, root: Node, walk: _Walk) -> None:
    # Runs after every step under check_invariants, over every node and page: each message is
    # built only on failure (an eager f-string formats nodes millions of times per test run).
    ps = tree.page_size
    refcount = tree.pool.refcount
    pages_seen = walk.pages
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for key, child in node.children.items():
            if child.parent is not node:
                _fail(f"{child!r} does not point back to its parent {node!r}")
            if not (child.hashes and key == child.hashes[0]):
                _fail(f"{child!r} is filed under a wrong key")
            if child.salt != root.salt:
                _fail(f"{child!r} has another salt than its root")
            if child.last_access > node.last_access:
                _fail(f"{child!r} was used after its parent {node!r}")
            if node is not root and child.num_hits > node.num_hits:
                _fail(f"{child!r} has more hits than its parent {node!r}")
            child_locks += child.lock_ref
            stack.append(child)
        if len(node.children) > 1 and node.liveness != Liveness.UNKNOWN:
            _fail(f"{node!r} is a branch point marked {node.liveness.name}")
        if node.lock_ref < child_locks:
            _fail(f"{node!r} has fewer locks than its children ({child_locks})")
        if node.removed:
            _fail(f"{node!r} is marked removed but still in the tree")
        if node is root:
            continue
        num = len(node.pages)
        if num < 1:
            _fail(f"{node!r} holds no block")
        if len(node.hashes) != num or len(node.tokens) != num * ps:
            _fail(f"{node!r} run lengths disagree")
        walk.nodes += 1
        walk.cached += num
        if node.parent is not root and not node.retains.items() <= node.parent.retains.items():
            _fail(f"{node!r} is retained below an unretained parent")
        if node.retention_expires_at_s != max(node.retains.values(), default=0.0):
            _fail(f"{node!r} has a stale retention_expires_at_s")
        walk.retention_ids.update(node.retains)
        walk.retained += num if node.retains else 0
        walk.protected += num if node.num_hits else 0
        unlocked = node.lock_ref == 0
        if unlocked:
            walk.evictable += num
            if not node.children:
                walk.unlocked_leaves.add(node.node_id)
        for page in node.pages:
            if page in pages_seen:
                _fail(f"page {page} is cached by two nodes")
            pages_seen.add(page)
            count = refcount(page)
            if count < 1:
                _fail(f"cached page {page} has refcount {count}")
            if unlocked and count != 1:
                _fail(f"evictable page {page} of {node!r} has refcount {count}, not 1")


def _check_subtree_hashes(tree: RadixTree, root: Node) -> None:
    stack: list[tuple[Node, BlockHash | None]] = [(child, None) for child in root.children.values()]
    while stack:
        node, parent_hash = stack.pop()
        expected = tree.hasher.hash_blocks(node.tokens, root.salt, parent=parent_hash)
        if expected != node.hashes:
            _fail(f"{node!r} stores hashes that do not match its tokens")
        stack.extend((child, node.hashes[-1]) for child in node.children.values())


@dataclass(slots=True)
class _Walk:
    nodes: int = 0
    cached: int = 0
    evictable: int = 0
    pages: set[int] = field(default_factory=set)
    unlocked_leaves: set[int] = field(default_factory=set)
    retained: int = 0
    protected: int = 0
    retention_ids: dict[int, float] = field(default_factory=dict)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _fail(message: str) -> None:
    raise AssertionError(message)
