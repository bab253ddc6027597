"""Liveness marks on the radix tree: what a session book says of a path's future (dead, cold,
hot), set on the nodes only that path runs through, never a branch point. Changes the marks and
the marked leaf's place in the eviction order, nothing else.
"""

from __future__ import annotations

from radixkv.cache.eviction import EvictionOrder, Liveness
from radixkv.cache.radix_node import Node, path_pages

# Liveness (session): set_liveness marks a node, the ancestors only its path runs through and
# the descendants that continue only it (one child each), never a branch point: a branch is
# shared, so no one session's end says anything of its future. HOT holds only while retained:
# mark_hot leaves what continues past the retained node unknown, and a node whose last
# retention goes (released by a cap, superseded, expired) is unknown again. For the same reason a node
# that gains a second child, and the upper half of a split (another request matched part of
# the run), go back to UNKNOWN. A mark walks O(depth) nodes but refiles at most one leaf
# (O(log n)): only leaves are in the eviction order, and a marked path ends in one.


def relabel(order: EvictionOrder, node: Node, liveness: Liveness) -> None:
    """Mark `node` alone, refiling it if it is a leaf in the eviction order."""
    if node.liveness == liveness:
        return

    def change(target: Node) -> None:
        target.liveness = liveness

    order.refile(node, change)


def mark_private_path(
    order: EvictionOrder, node: Node, liveness: Liveness, *, below_blocks: int = 0, tail: Liveness | None = None
) -> int:
    """Mark the path private to `node` with `liveness`: the node, its ancestors up to the
    first branch point or the root, and its descendants down to the first branch point or
    the leaf (what was cached after the prefix the caller knows: a turn's reply), refiling
    the leaf among them; the `session` and `slru` policies order by it. With `below_blocks`, only
    nodes that lie wholly past the path's first `below_blocks` blocks (what the caller
    knows is shared, e.g. the system prompt a session's first turn found cached). An
    evicted node stands for what is left of its path: its deepest ancestor still cached (a
    removed node keeps its parent), so a session book may hold on to a stale node. Changes
    the eviction order; returns the nodes marked (0 for a root or a branch point: no mark
    on them means anything). `tail`: the descendants' mark, where it differs from the
    node's own (a hot turn is hot only as far as it is retained)."""
    while node.removed and node.parent is not None:
        node = node.parent
    if node.parent is None or len(node.children) > 1:
        return 0
    marked = 0
    end_block = path_pages(node)
    below, below_start = node, end_block
    while len(below.children) == 1:
        below = next(iter(below.children.values()))
        if len(below.children) > 1:
            break
        if below_start >= below_blocks:
            relabel(order, below, liveness if tail is None else tail)
            marked += 1
        below_start += len(below.pages)
    current: Node = node
    while True:
        start_block = end_block - len(current.pages)
        if start_block < below_blocks:
            return marked
        relabel(order, current, liveness)
        marked += 1
        parent = current.parent
        assert parent is not None
        if parent.parent is None or len(parent.children) != 1:
            return marked
        current, end_block = parent, start_block
