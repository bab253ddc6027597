"""The engine's side of the `predict` eviction policy: each finished request is told to the
online dead-block predictor (cache/dead_blocks.py), which marks the tree's liveness through
KVManager.mark, the one place marks are made; a session its client releases (SessionBook.release,
wired to `released` by the engine) is told too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.dead_blocks import DeadBlockPredictor

if TYPE_CHECKING:
    from collections.abc import Callable

    from radixkv.cache.hashing import BlockHasher
    from radixkv.cache.radix import RadixTree
    from radixkv.engine.kv_manager import KVManager
    from radixkv.engine.request import RequestOutput
    from radixkv.engine.sessions import SessionRef


class PredictedLiveness:
    """Requests in flight (their salt and session name, until they finish or drop) and the
    predictor they feed. A session's name (owner, namespace, key) is the client's own signal:
    its turns follow one another by name."""

    def __init__(self, kv: KVManager, tree: RadixTree, hasher: BlockHasher, clock: Callable[[], float]) -> None:
        self._tree = tree
        self._hasher = hasher
        self._clock = clock
        # Guarded by a duel against a shadow LRU the pool's size (cache/duel.py).
        pages = kv.cache_view().pool.num_pages
        self.predictor = DeadBlockPredictor(lambda node, liveness, below: kv.mark(node, liveness, below_blocks=below), guard_blocks=pages)
        self._in_flight: dict[str, tuple[str | None, object]] = {}

    def begin(self, request_id: str, salt: str | None, session: SessionRef | None) -> None:
        name = None if session is None else (session.owner, session.namespace, session.key)
        self._in_flight[request_id] = (salt, name)

    def finished(self, output: RequestOutput) -> None:
        entry = self._in_flight.pop(output.request_id, None)
        if entry is None:
            return
        salt, name = entry
        tokens = list(output.prompt_token_ids)
        hashes = self._hasher.hash_blocks(tokens, salt)
        node = self._tree.deepest_node(tokens, salt, block_hashes=hashes)
        cached = output.num_cached_tokens // self._hasher.page_size
        self.predictor.served(hashes, node, cached, self._clock(), name=name)

    def dropped(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)

    def released(self, session: SessionRef) -> bool:
        """The client ended a session (DELETE): its private tail is dead."""
        return self.predictor.release_name((session.owner, session.namespace, session.key))
