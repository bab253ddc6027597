"""KVKeeps: the KV manager's verbs that keep a prefix cached past its request (pin, retain) and
mark its liveness; a base of KVManager, over the same private parts, so its callers see one class.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.cache.eviction import Liveness
from radixkv.cache.layer_groups import WindowPages
from radixkv.cache.radix import Node, PeekResult, RadixTree
from radixkv.cache.residency import PageResidency
from radixkv.engine.disk_loader import DiskLoader


class KVKeeps:
    """Pins, retention and liveness marks over the tree KVManager holds (its attributes below)."""

    _tree: RadixTree
    _caching: bool
    _page_size: int
    _loader: DiskLoader | None
    _residency: PageResidency
    _windows: WindowPages | None

    # -- pins and retention ------------------------------------------------------------------

    def peek_prefix(self, token_ids: list[int], salt: str | None) -> PeekResult:
        """What a match of these tokens would serve now; pure."""
        if not self._caching:
            return PeekResult(0, [], 0)
        return self._tree.peek(token_ids, salt)

    def pin(self, prefix_token_ids: list[int], salt: str | None) -> tuple[Node, int]:
        """Lock the cached full blocks of a prefix; (the node to unpin, tokens pinned)."""
        # match() leaves the last token to compute; one more token lets it return every full
        # block of the prefix itself (a partial block never matches).
        match = self._tree.match(list(prefix_token_ids) + [0], salt, record=False)
        windows = self._windows
        if windows is not None:  # layer groups: pinned up to where the window layers hold theirs, and those held
            cut = windows.usable_tokens(match.pages, match.num_cached_tokens)
            if cut < match.num_cached_tokens:
                match = self._tree.match(list(prefix_token_ids[:cut]) + [0], salt, record=False)
            windows.pin(match.node, match.pages, windows.first_block(cut))
        self._tree.lock(match.node)
        return match.node, match.num_cached_tokens

    def unpin(self, node: Node) -> None:
        if self._windows is not None:
            self._windows.unpin(node)
        self._tree.unlock(node)

    def retain(self, prefix_token_ids: list[int], salt: str | None, ttl_s: float, owner: str | None, max_owner_pages: int) -> int:
        """Retain the cached full blocks of a prefix for ttl_s seconds (no lock: they go last,
        not never), written through to the disk tier; returns tokens retained. A prefix longer
        than the owner's cap retains its first max_owner_pages pages, and the tree's cap over
        all owners may trim it further."""
        if not self._caching or max_owner_pages <= 0:
            return 0
        if self._loader is not None:
            self._loader.claim(owner)  # what came back from disk under its name counts here too
        node, num_pages = self._retain_prefix(prefix_token_ids[: max_owner_pages * self._page_size], salt, ttl_s, owner, max_owner_pages)
        if num_pages and self._loader is not None:
            self._loader.write_through(node)
        return num_pages * self._page_size

    def _retain_prefix(
        self, prefix_token_ids: Sequence[int], salt: str | None, ttl_s: float, owner: str | None, max_owner_pages: int | None
    ) -> tuple[Node, int]:
        """Retain the cached full blocks of a prefix (RadixTree.retain), marked retained in RAM
        residency: (the node its match ends at, pages retained). Also what the disk loader
        does for a block read back under a live retention."""
        # As in pin: one more token lets match return every full block of the prefix itself.
        # Retaining serves no request: counted as a hit, it would make the path protected under
        # slru, outranking other keys' real hits once the retention ends.
        match = self._tree.match(list(prefix_token_ids) + [0], salt, record=False, serves=False)
        num_pages = self._tree.retain(match.node, ttl_s, owner, max_owner_pages)
        self._residency.retained(match.pages[:num_pages])
        if num_pages and self._windows is not None:
            # The newest retention is this one; the window layers keep the W tokens before its
            # cut, so the retained prefix stays a full hit there, not only its full layers.
            retention = self._tree.retentions(owner)[-1]
            self._windows.keep(retention.retention_id, match.pages[:num_pages], num_pages * self._page_size)
        return match.node, num_pages

    # -- liveness (a session book's marks; the `session` eviction policy orders by them) -----

    def mark(
        self, target: Node | Sequence[int], liveness: Liveness, *, salt: str | None = None, below_blocks: int = 0
    ) -> int:
        """The one place liveness is marked: `target`'s private path past its first
        `below_blocks` blocks (RadixTree.set_liveness); `target` a node, or a prefix's tokens
        under `salt` (the deepest cached node its full blocks cover; 0 when none). HOT holds as
        far as `target`, what its retention holds (RadixTree.mark_hot). Returns the nodes
        marked; changes only the marks."""
        if not self._caching:
            return 0
        node = target if isinstance(target, Node) else self._tree.deepest_node(target, salt)
        if node is None:
            return 0
        if liveness is Liveness.HOT:
            return self._tree.mark_hot(node, below_blocks=below_blocks)
        return self._tree.set_liveness(node, liveness, below_blocks=below_blocks)
