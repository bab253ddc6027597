"""Sessions: a name an owner gives a conversation (OpenAI's prompt_cache_key, the
X-Radixkv-Session header) so its newest turn (prompt and reply) stays retained between turns for
an idle time, is released on request, and is read back from disk as soon as the next turn comes.
The book names and caps sessions: a turn is a keep its request carries (into the reply, applied
by the engine's Keeper when the request finishes); the book makes its room and marks the tails.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sortedcontainers import SortedList

from radixkv.cache.eviction import Liveness
from radixkv.cache.radix_node import path_tokens
from radixkv.engine.keeps import TurnRoom
from radixkv.engine.request import Keep
from radixkv.errors import InvalidRequest, OwnerCapExceeded

if TYPE_CHECKING:
    from radixkv.cache.radix import Node, RadixTree
    from radixkv.cache.retention import Retention
    from radixkv.config import EngineConfig
    from radixkv.engine.disk_loader import DiskLoader
    from radixkv.engine.kv_manager import KVManager
    from radixkv.engine.pins import Owner
    from radixkv.engine.request import SequenceState

# A session key is the client's own string; bounded so a book entry costs little (OpenAI's
# prompt_cache_key takes up to this many characters on radixkv's wire too).
MAX_SESSION_KEY_CHARS = 1024


class TailSignals(Protocol):
    """What sessions tell the eviction order about the paths they held (KVManager.mark, which
    the `slru` and `session` eviction policies order by): a released or idle-expired session's
    private tail will not be used again (DEAD); a turn its successor superseded is unlikely to
    be (COLD); a live session's newest turn is about to be (HOT). `below_blocks`: the path's
    first blocks are shared (the session found them cached) and keep their mark. Nothing is
    evicted here."""

    def mark(self, target: Node, liveness: Liveness, *, below_blocks: int = 0) -> int: ...


class NoSignals:
    """An eviction order that takes no session signals: every call does nothing."""

    def mark(self, target: Node, liveness: Liveness, *, below_blocks: int = 0) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class SessionRef:
    """A request's claim to a session: whose (the API key's owner, never a salt) and which key;
    `idle_s` overrides EngineConfig.session_idle_s for this turn (at most max_session_idle_s).
    `namespace` sets one caller's keys apart from another's within one owner (a keyless
    server's callers are one owner: their cache partition, server/sessions.py); the owner's
    caps count every namespace together.

    `parent`: the key of the owner's session this one branches from (a subagent's: its prompt
    starts with the parent's prefix), looked up among the owner's own sessions in the same
    namespace; another owner's, or none, is simply not found. `final`: this turn is the
    session's last: once it finishes the session ends and its private tail (past what the
    parent holds) is marked dead, while the parent's prefix stays as the parent keeps it."""

    owner: Owner
    key: str
    idle_s: float | None = None
    namespace: str | None = None
    parent: str | None = None
    final: bool = False


@dataclass(slots=True, eq=False)
class Session:
    """One live session: what it retains now and until when."""

    session_id: int
    owner: Owner
    key: str
    salt: str | None
    idle_s: float
    created_at_s: float  # on the tree's clock, as every moment here
    last_active_at_s: float
    retention_id: int | None = None  # the newest turn's retention; None before a turn finished
    node: Node | None = None  # the deepest node that retention holds
    num_retained_tokens: int = 0
    num_turns: int = 0
    num_shared_tokens: int | None = None  # what its first turn found cached: shared, never its own
    in_flight: set[str] = field(default_factory=set)  # request ids of turns not finished yet
    namespace: str | None = None  # SessionRef.namespace
    parent_id: int | None = None  # the owner's session it branches from (SessionRef.parent), if found

    @property
    def name(self) -> tuple[str | None, str]:
        """Its name within its owner: (namespace, key)."""
        return self.namespace, self.key

    @property
    def expires_at_s(self) -> float:
        return self.last_active_at_s + self.idle_s


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session as its owner sees it (GET /v1/cache/sessions)."""

    key: str
    num_retained_tokens: int
    num_turns: int
    idle_s: float
    expires_in_s: float
    in_flight: int


@dataclass(frozen=True, slots=True)
class SessionLimits:
    default_idle_s: float
    max_idle_s: float
    max_sessions_per_owner: int
    max_pages_per_owner: int  # over the owner's sessions
    max_retained_pages_per_owner: int  # over all the owner's retentions (EngineConfig's, shared)

    @classmethod
    def of(cls, config: EngineConfig) -> SessionLimits:
        """The config's session knobs (the session pages within the owner's retention cap)."""
        retained = config.max_retained_pages_per_owner
        return cls(
            config.session_idle_s, config.max_session_idle_s, config.max_sessions_per_owner,
            min(config.max_session_pages_per_owner, retained), retained,
        )  # fmt: skip


class SessionBook:
    """Every live session by (owner, key): another owner's key is a different session, and
    every answer about one (list, release) reads as if it did not exist. A turn is a keep into
    the reply (`check` makes it) that the Keeper retains when the request finishes (no lock;
    retained leaves go last and are written to disk), counted against the owner's retention cap
    too; the book makes its room (`room`) and hears what was kept (`kept`). Meets keeps.Turns.
    Touched only on the engine's thread."""

    def __init__(
        self,
        kv: KVManager,
        tree: RadixTree,
        limits: SessionLimits,
        *,
        chunk_tokens: int,
        clock: Callable[[], float],
        signals: TailSignals | None = None,
        released: Callable[[SessionRef], object] | None = None,
    ) -> None:
        self._kv = kv  # load_ready: a resumed session's read-ahead
        self._tree = tree  # the turns' retentions (looked up and released; made by the Keeper)
        self._page_size = tree.pool.page_size
        self.limits = limits
        self._chunk_tokens = chunk_tokens
        self._clock = clock
        self.signals: TailSignals = signals if signals is not None else NoSignals()
        self._released = released  # told of every release its owner asks for (the `predict` policy's predictor)
        self._sessions: dict[tuple[Owner, str | None, str], Session] = {}  # (owner, namespace, key)
        self._by_id: dict[int, Session] = {}
        self._by_owner: dict[Owner, dict[tuple[str | None, str], Session]] = {}  # by name; least recently active first
        self._by_expiry: SortedList = SortedList()  # (expires_at_s, session_id) of idle sessions
        self._turns: dict[str, Session] = {}  # request id -> the session its turn belongs to
        self._final: set[str] = set()  # request ids of turns that are their session's last
        self._ids = itertools.count(1)
        self.num_resumed = 0  # requests that named a live session
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    # -- a request's turn ----------------------------------------------------------------------

    def check(self, ref: SessionRef, num_prompt_tokens: int) -> Keep:
        """InvalidRequest (OwnerCapExceeded past the owner's session count) unless `ref` may
        start or continue a turn; the turn's keep (the whole prompt and the reply, for the idle
        time). Changes nothing but expiring idle sessions."""
        if not isinstance(ref.key, str) or not 0 < len(ref.key) <= MAX_SESSION_KEY_CHARS:
            raise InvalidRequest(
                f"a session key must be 1 to {MAX_SESSION_KEY_CHARS} characters", param="session", limit=MAX_SESSION_KEY_CHARS
            )
        if ref.parent is not None and (not isinstance(ref.parent, str) or not 0 < len(ref.parent) <= MAX_SESSION_KEY_CHARS):
            raise InvalidRequest(
                f"a parent session key must be 1 to {MAX_SESSION_KEY_CHARS} characters",
                param="session_parent",
                limit=MAX_SESSION_KEY_CHARS,
            )
        if not isinstance(ref.final, bool):
            raise InvalidRequest(f"a session turn's final flag must be a boolean, got {ref.final!r}", param="session_final")
        idle_s = self.limits.default_idle_s if ref.idle_s is None else ref.idle_s
        if isinstance(idle_s, bool) or not isinstance(idle_s, (int, float)) or not 0 < idle_s <= self.limits.max_idle_s:
            raise InvalidRequest(
                f"a session's idle time must be a number of seconds in (0, {self.limits.max_idle_s:g}], got {idle_s!r}",
                param="session_idle_s",
                limit=int(self.limits.max_idle_s),
            )
        self.expire()
        mine = self._by_owner.get(ref.owner, {})
        full = (ref.namespace, ref.key) not in mine and len(mine) >= self.limits.max_sessions_per_owner
        if full and self._idlest(ref.owner) is None:
            raise OwnerCapExceeded(
                f"this owner has {len(mine)} live sessions, each with a turn running; each owner (API key) may hold at "
                f"most {self.limits.max_sessions_per_owner}; retry once a turn ends",
                param="session",
                code="session_limit_exceeded",
                limit=self.limits.max_sessions_per_owner,
            )
        return Keep(num_prompt_tokens, float(idle_s), reply=True)

    def begin(self, request_id: str, ref: SessionRef, turn: Keep, salt: str | None, seqs: list[SequenceState]) -> None:
        """Bind a queued request carrying `turn` (check's keep) to its session (made now if new).
        Resuming a session starts reading its disk blocks ahead at once, before admission."""
        assert turn.ttl_s is not None, "check() gives a turn its idle time"
        idle_s, now_s = turn.ttl_s, self._clock()
        session = self._sessions.get((ref.owner, ref.namespace, ref.key))
        if session is None:
            mine = self._by_owner.get(ref.owner, {})
            if len(mine) >= self.limits.max_sessions_per_owner:
                # A session key is a hint clients send unasked (one per conversation): past the
                # count, the owner's least recently active idle session makes room, as a full
                # cache would evict it; only an owner whose sessions all run is refused (check).
                idlest = self._idlest(ref.owner)
                assert idlest is not None, "check() found one a moment ago"
                self._end(idlest)
            session = Session(next(self._ids), ref.owner, ref.key, salt, idle_s, now_s, now_s, namespace=ref.namespace)
            self._sessions[(ref.owner, ref.namespace, ref.key)] = session
            self._by_id[session.session_id] = session
        else:
            self._unfile(session)
            self._by_owner[ref.owner].pop(session.name)
            self.num_resumed += 1
            session.salt, session.idle_s, session.last_active_at_s = salt, idle_s, now_s
            for seq in seqs:
                self._kv.load_ready(seq, self._chunk_tokens)  # starts the read-ahead (if on disk)
        if ref.parent is not None and session.parent_id is None:
            # The owner's own session of that name, in this namespace; any other is not found.
            parent = self._sessions.get((ref.owner, ref.namespace, ref.parent))
            if parent is not None and parent is not session:
                session.parent_id = parent.session_id
        self._by_owner.setdefault(ref.owner, {})[session.name] = session  # now the most recently active
        session.in_flight.add(request_id)
        self._turns[request_id] = session
        if ref.final:
            self._final.add(request_id)

    def read_ahead(self, ref: SessionRef, loader: DiskLoader | None) -> int:
        """A resume named before its request is read (the session header): start reading the
        session's newest turn back from disk (DiskLoader.read_ahead), so the request finds it
        read; the owner's own session in its namespace only, any other is not found and starts
        nothing. Returns the blocks being read. Changes nothing in the book."""
        session = self._sessions.get((ref.owner, ref.namespace, ref.key))
        if loader is None or session is None or session.node is None:
            return 0
        return loader.read_ahead(path_tokens(session.node), session.salt)  # the path outlives its eviction

    def room(self, request_id: str, num_tokens: int, num_cached_tokens: int) -> TurnRoom | None:
        """The request's turn ends (keeps.Turns): its session's room for the turn's `num_tokens`
        (prompt and reply) beside the owner's other sessions, whose least recently active give
        theirs up first; None (and the turn is over) if its session was released meanwhile."""
        session = self._turns.get(request_id)
        if session is None or self._sessions.get((session.owner, *session.name)) is not session:
            self.dropped(request_id)
            return None  # released while the turn ran: the release stands
        if session.num_shared_tokens is None:
            session.num_shared_tokens = num_cached_tokens
        if request_id in self._final:
            return TurnRoom(session.owner, num_tokens, final=True)  # nothing retained: `ended` follows
        page_size = self._page_size
        room = self.limits.max_pages_per_owner - sum(
            s.num_retained_tokens // page_size for s in self._by_owner.get(session.owner, {}).values() if s is not session
        )
        # Past the owner's session pages, its least recently active sessions give theirs up
        # first (never another owner's): the newest turn is the one about to be used. Trimmed
        # to that room; the retention cap the Keeper passes on is the owner's own over all its
        # retentions, so the owner's other retentions are not released to fit the room.
        # A child never makes its parents give theirs up: it is about to read their prefix.
        parents = self._parents(session)
        for other in list(self._by_owner.get(session.owner, {}).values()):
            if room * page_size >= num_tokens or other is session:
                break
            if other.session_id in parents:
                continue
            room += other.num_retained_tokens // page_size
            self._drop_retention(other, dead=True)
        return TurnRoom(session.owner, min(num_tokens, max(0, room) * page_size))

    def kept(self, request_id: str, retention: Retention | None, num_tokens: int) -> None:
        """The Keeper retained the turn `room` made room for (keeps.Turns): it takes the previous
        turn's place (released; marked cold where the new turn does not continue it), its tail is
        marked hot, and the session idles from now."""
        session = self._turns.pop(request_id)
        session.in_flight.discard(request_id)
        old_id, old_node = session.retention_id, session.node
        session.retention_id = retention.retention_id if retention is not None else None
        session.node = retention.node if retention is not None else None
        session.num_retained_tokens = num_tokens
        if old_id is not None and old_id != session.retention_id:
            self._tree.release(old_id)  # already gone where the new turn's retention covers it
            if old_node is not None and not _on_path(old_node, session.node):
                self.signals.mark(old_node, Liveness.COLD, below_blocks=self._shared_blocks(session))  # what the new turn does not continue
        if session.node is not None:
            self.signals.mark(session.node, Liveness.HOT, below_blocks=self._shared_blocks(session))
            self._keep_parents(session)
        session.num_turns += 1
        session.last_active_at_s = self._clock()
        self._file(session)

    def ended(self, request_id: str, tokens: list[int], salt: str | None) -> None:
        """A final turn finished (keeps.Turns; `room` said final) with `tokens` (prompt and
        reply): its session ends now, its private tail (this turn's and its last retained
        turn's, past the prefix it shares with its parent or found cached) marked dead; the
        parent's prefix keeps whatever the parent session holds."""
        self._final.discard(request_id)
        session = self._turns.pop(request_id)
        session.in_flight.discard(request_id)
        if self._sessions.get((session.owner, *session.name)) is not session:
            return  # released meanwhile: the release stands
        node = self._tree.deepest_node(tokens, salt) if tokens else None
        if node is not None:
            self.signals.mark(node, Liveness.DEAD, below_blocks=self._shared_blocks(session, node))
        self._end(session)

    def dropped(self, request_id: str) -> None:
        """A request left without output to retain (aborted, failed): its session only idles."""
        self._final.discard(request_id)
        session = self._turns.pop(request_id, None)
        if session is not None:
            session.in_flight.discard(request_id)
            if self._sessions.get((session.owner, *session.name)) is session:
                self._unfile(session)
                self._file(session)

    # -- the owner's calls ---------------------------------------------------------------------

    def release(self, owner: Owner, key: str, namespace: str | None = None) -> bool:
        """End `owner`'s session `key` now; False if there is none (another owner's or another
        namespace's included). `released` hears of it either way (the client's word that the
        conversation is over stands after an idle expiry too; a name is its owner's own)."""
        self.expire()
        if self._released is not None:
            self._released(SessionRef(owner, key, namespace=namespace))
        session = self._sessions.get((owner, namespace, key))
        if session is None:
            return False
        self._end(session)
        return True

    def of_owner(self, owner: Owner, namespace: str | None = None) -> list[SessionInfo]:
        """`owner`'s live sessions in `namespace`, least recently active first."""
        self.expire()
        now_s = self._clock()
        return [
            SessionInfo(s.key, self._live_tokens(s), s.num_turns, s.idle_s, max(0.0, s.expires_at_s - now_s), len(s.in_flight))
            for s in self._by_owner.get(owner, {}).values()
            if s.namespace == namespace
        ]

    def get(self, owner: Owner, key: str, namespace: str | None = None) -> Session | None:
        self.expire()
        return self._sessions.get((owner, namespace, key))

    def expire(self) -> int:
        """End every session idle past its time (none with a turn in flight); how many did."""
        now_s = self._clock()
        ended = 0
        while self._by_expiry and self._by_expiry[0][0] <= now_s:
            _, session_id = self._by_expiry.pop(0)
            session = self._by_id.get(session_id)
            if session is not None:
                self._end(session)
                self.num_expired += 1
                ended += 1
        return ended

    # -- internals -----------------------------------------------------------------------------

    def _shared_blocks(self, session: Session, node: Node | None = None) -> int:
        """The blocks of `session`'s path (to `node`, else its retained node) that are not its
        own: what its first turn found cached, or, for a child, what it shares with its parent's
        retained path, whichever is more; pure."""
        own = (session.num_shared_tokens or 0) // self._page_size
        parent = self._by_id.get(session.parent_id) if session.parent_id is not None else None
        node = node if node is not None else session.node
        if parent is None or parent.node is None or parent.node.removed or node is None:
            return own
        return max(own, _common_blocks(node, parent.node))

    def _keep_parents(self, child: Session) -> None:
        """A child's turn covers its parents' prefix, so the tree let it supersede their
        retentions (one owner's retention covering another's, RadixTree.retain): each parent's
        newest turn is retained again, for what is left of its idle time, so it outlives the
        child (a final child's tail goes, the parent's prefix stays, as the parent keeps it)."""
        now_s = self._clock()
        for parent_id in self._parents(child):
            parent = self._by_id[parent_id]
            if parent.retention_id is None or parent.node is None or parent.node.removed:
                continue
            if self._tree.retention(parent.retention_id) is not None:
                continue
            ttl_s = parent.expires_at_s - now_s
            if ttl_s <= 0:
                continue
            num = self._kv.retain(path_tokens(parent.node), parent.salt, ttl_s, parent.owner, self.limits.max_retained_pages_per_owner)
            retention = self._tree.retentions(parent.owner)[-1] if num else None
            parent.retention_id = retention.retention_id if retention is not None else None
            parent.node = retention.node if retention is not None else parent.node

    def _parents(self, session: Session) -> set[int]:
        """The ids of the live sessions `session` branches from, its parent's parent included."""
        found: set[int] = set()
        parent_id = session.parent_id
        while parent_id is not None and parent_id not in found and parent_id in self._by_id:
            found.add(parent_id)
            parent_id = self._by_id[parent_id].parent_id
        return found

    def _idlest(self, owner: Owner) -> Session | None:
        """The owner's least recently active session with no turn running; None if none."""
        return next((s for s in self._by_owner.get(owner, {}).values() if not s.in_flight), None)

    def _live_tokens(self, session: Session) -> int:
        if session.retention_id is None or self._tree.retention(session.retention_id) is None:
            return 0  # the owner's other retentions or the caps took it
        return session.num_retained_tokens

    def _end(self, session: Session) -> None:
        self._unfile(session)
        self._drop_retention(session, dead=True)
        del self._sessions[(session.owner, *session.name)]
        del self._by_id[session.session_id]
        mine = self._by_owner[session.owner]
        del mine[session.name]
        if not mine:
            del self._by_owner[session.owner]

    def _drop_retention(self, session: Session, *, dead: bool) -> None:
        if session.retention_id is not None:
            self._tree.release(session.retention_id)
        if session.node is not None and dead:
            self.signals.mark(session.node, Liveness.DEAD, below_blocks=self._shared_blocks(session))
        session.retention_id, session.node, session.num_retained_tokens = None, None, 0

    def _file(self, session: Session) -> None:
        if not session.in_flight:
            self._by_expiry.add((session.expires_at_s, session.session_id))

    def _unfile(self, session: Session) -> None:
        self._by_expiry.discard((session.expires_at_s, session.session_id))


def _common_blocks(a: Node, b: Node) -> int:
    """The blocks two nodes' paths share from the root (their deepest common ancestor's depth,
    counting whole nodes: match and insert split nodes where paths part); pure."""
    ancestors = set()
    current: Node | None = b
    while current is not None:
        ancestors.add(id(current))
        current = current.parent
    current = a
    while current is not None and id(current) not in ancestors:
        current = current.parent
    blocks = 0
    while current is not None:
        blocks += len(current.pages)
        current = current.parent
    return blocks


def _on_path(node: Node, deepest: Node | None) -> bool:
    """Whether `node` is `deepest` or one of its ancestors (the new turn continues it)."""
    current = deepest
    while current is not None:
        if current is node:
            return True
        current = current.parent
    return False
