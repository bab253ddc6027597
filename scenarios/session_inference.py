"""Sessions inferred from shared prefixes where a trace names none, from what an online server
sees (no future): a request whose prompt extends an earlier request's whole prompt continues
that request's session; or named by the client where it names them. It marks the tree for the
`session` eviction policy (RadixTree.set_liveness).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from radixkv.cache import BlockHash, Node, RadixTree


@dataclass(frozen=True, slots=True)
class IdleRule:
    """When a session counts as over (its private tail dead): idle longer than `idle_s` of
    trace time, or not extended within `idle_requests` later requests; None: that rule is off."""

    idle_s: float | None = None
    idle_requests: int | None = None

    def expired(self, session: InferredSession, now_s: float, request_number: int) -> bool:
        if self.idle_s is not None and now_s - session.last_at_s > self.idle_s:
            return True
        return self.idle_requests is not None and request_number - session.last_request > self.idle_requests


@dataclass(slots=True, eq=False)
class InferredSession:
    session_id: int
    node: Node  # the newest turn's deepest cached node (evicted since, it stands for what is left)
    shared_blocks: int  # blocks the first turn found cached: shared with others, never marked
    last_at_s: float
    last_request: int
    num_turns: int = 1
    ends: list[BlockHash] = field(default_factory=list)  # each turn's last block hash
    name: int | None = None  # the client's name for it, where it names its sessions


class SessionInference:
    """Infers sessions request by request and marks the tree:

    - a request that extends no live session's prompt starts a session of one turn and is not
      marked (UNKNOWN): most lone requests are never extended, so a live session's newest turn
      is worth more than one;
    - a request that extends a live session's prompt (its newest turn or an earlier one, a
      fork) is that session's newest turn: its private path is marked HOT, and the session's
      previous newest turn COLD (superseded; where the new turn runs through it, HOT wins);
    - a session that the idle rule expires has its private path marked DEAD.
    The part of a path the session's first turn found cached is shared (a system prompt) and
    never marked. Requests must come in trace order (times never decrease).

    With `named`, sessions are not inferred but named by the client (a trace's session ids, a
    server's prompt_cache_key): a named session is HOT from its first turn, a request without
    a name is a lone one, and a session the client releases is DEAD at once."""

    def __init__(self, tree: RadixTree, rule: IdleRule, named: bool = False) -> None:
        if rule.idle_s is None and rule.idle_requests is None:
            raise ValueError("an IdleRule needs idle_s or idle_requests: sessions would never end")
        self.tree = tree
        self.rule = rule
        self.named = named
        self._by_end: dict[BlockHash, InferredSession] = {}
        self._by_name: dict[int, InferredSession] = {}
        self._live: OrderedDict[int, InferredSession] = OrderedDict()  # least recently extended first
        self._next_id = 0
        self.num_sessions = 0  # sessions started
        self.num_continued = 0  # requests that continued a session
        self.num_expired = 0
        self.num_released = 0

    def served(
        self,
        block_hashes: list[BlockHash],
        node: Node,
        cached_blocks: int,
        at_s: float,
        request_number: int,
        *,
        name: int | None = None,
        released: bool = False,
    ) -> None:
        """One request was served: its full blocks' hashes, the deepest node now caching them,
        the blocks it found cached, its arrival time; under `named`, its session's name (None:
        none) and whether the client released the session after it. Marks the tree."""
        self._expire(at_s, request_number)
        if self.named:
            session = self._by_name.get(name) if name is not None else None
        else:
            session = self._extended(block_hashes)
        if session is None:
            session = self._start(node, cached_blocks, at_s, request_number, name)
        else:
            self._continue(session, node, at_s, request_number)
        if block_hashes and not self.named:
            self._by_end[block_hashes[-1]] = session
            session.ends.append(block_hashes[-1])
        if released:
            self._end(session)
            self.num_released += 1

    def _start(self, node: Node, cached_blocks: int, at_s: float, request_number: int, name: int | None) -> InferredSession:
        session = InferredSession(self._next_id, node, cached_blocks, at_s, request_number, name=name)
        self._next_id += 1
        self.num_sessions += 1
        self._live[session.session_id] = session
        if name is not None:
            self._by_name[name] = session
            self.tree.mark_hot(node, below_blocks=session.shared_blocks)
        return session

    def _continue(self, session: InferredSession, node: Node, at_s: float, request_number: int) -> None:
        self.num_continued += 1
        if session.node is not node:
            self.tree.mark_cold(session.node, below_blocks=session.shared_blocks)
        session.node, session.last_at_s, session.last_request = node, at_s, request_number
        session.num_turns += 1
        self.tree.mark_hot(node, below_blocks=session.shared_blocks)
        self._live.move_to_end(session.session_id)

    def _extended(self, block_hashes: list[BlockHash]) -> InferredSession | None:
        """The live session one of whose turns' whole prompt is the longest prefix of this
        one; None when none is."""
        for num_blocks in range(len(block_hashes), 0, -1):
            session = self._by_end.get(block_hashes[num_blocks - 1])
            if session is not None:
                return session
        return None

    def _expire(self, now_s: float, request_number: int) -> None:
        while self._live:
            session = next(iter(self._live.values()))
            if not self.rule.expired(session, now_s, request_number):
                return
            self._end(session)
            self.num_expired += 1

    def _end(self, session: InferredSession) -> None:
        """The session is over: its private path is dead and no later request continues it."""
        del self._live[session.session_id]
        for end in session.ends:
            if self._by_end.get(end) is session:
                del self._by_end[end]
        if session.name is not None and self._by_name.get(session.name) is session:
            del self._by_name[session.name]
        self.tree.mark_dead(session.node, below_blocks=session.shared_blocks)
