"""Keeps: what a request asks to stay cached, applied once, right after the step that computed its
prompt (a keep into the reply: when the request finishes), through KVManager's retain (unlocked)
and the pins (locked), under the owner's caps. The report it makes is the only source of the
wire's cache-write usage fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from radixkv.engine.kv_manager import KVManager
from radixkv.engine.pins import Owner, Pins
from radixkv.engine.request import MAX_KEEPS, Keep, KeepReport, SequenceState
from radixkv.errors import InvalidRequest

if TYPE_CHECKING:
    from radixkv.cache.radix import RadixTree
    from radixkv.cache.retention import Retention
    from radixkv.engine.request_output import RequestOutput


def check_keeps(keeps: Sequence[Keep], num_prompt_tokens: int) -> tuple[Keep, ...]:
    """The keeps as a tuple; InvalidRequest (param "keeps", the limit as data) for more than
    MAX_KEEPS, a keep that is no Keep, one past the prompt or with a lifetime it may not have,
    or one into the reply (only a session makes those: Engine.add_request(session=...))."""
    keeps = tuple(keeps)
    if len(keeps) > MAX_KEEPS:
        raise InvalidRequest(f"a request may keep at most {MAX_KEEPS} prefixes, got {len(keeps)}", param="keeps", limit=MAX_KEEPS)
    for keep in keeps:
        if not isinstance(keep, Keep):
            raise InvalidRequest(f"keeps must be Keep records, got {type(keep).__name__}", param="keeps")
        keep.check(num_prompt_tokens)
        if keep.reply:
            raise InvalidRequest("a keep into the reply is a session's turn: name the session instead", param="keeps")
    return keeps


@dataclass(frozen=True, slots=True)
class TurnRoom:
    """Where a finished turn's reply keep goes: whose retention it is and how many of its tokens
    fit beside the owner's other sessions. `final`: the turn is its session's last, so nothing
    is retained and the book hears `ended` instead of `kept`."""

    owner: Owner
    num_tokens: int
    final: bool = False


class Turns(Protocol):
    """The book of requests that are turns of a session (engine/sessions.py's SessionBook)."""

    def room(self, request_id: str, num_tokens: int, num_cached_tokens: int) -> TurnRoom | None:
        """The request's turn ends: where its reply keep of `num_tokens` goes, room made under
        its owner's session caps; None (the turn is over) if its session is gone. Unless None,
        `kept` follows (`ended`, where the room says final)."""
        ...

    def kept(self, request_id: str, retention: Retention | None, num_tokens: int) -> None:
        """The turn's keep was applied (`retention` None: nothing was kept)."""

    def ended(self, request_id: str, tokens: list[int], salt: str | None) -> None:
        """The session's final turn finished with `tokens` (prompt and reply): the session ends."""
        ...


class Keeper:
    """Applies a request's keeps when its prompt is computed. Unlocked keeps retain (the owner's
    retention cap, EngineConfig.max_retained_pages_per_owner, and the tree's cap over all
    owners may trim them); a locked keep pins (Pins: per owner and over all owners), and a pin
    the caps refuse is reported, not raised, so the request itself runs on. Engine thread only."""

    def __init__(
        self,
        kv: KVManager,
        tree: RadixTree,
        pins: Pins,
        max_retained_pages_per_owner: int,
        clock: Callable[[], float],
        turns: Turns | None = None,
    ) -> None:
        self._kv = kv
        self._tree = tree  # the retention a turn's keep just made, for the session book
        self._pins = pins
        self._max_retained_pages_per_owner = max_retained_pages_per_owner
        self._clock = clock
        self._turns = turns

    def due(self, seq: SequenceState) -> bool:
        """Whether seq's prompt keeps are to be applied now: it has some, its request has not
        applied them, and its whole prompt is computed (and committed); pure."""
        return seq.kept is None and seq.num_computed_tokens >= len(seq.prompt_token_ids) and any(not k.reply for k in seq.keeps)

    def apply(self, seq: SequenceState, num_cached_tokens: int) -> KeepReport:
        """Retain or pin each of seq's prompt keeps, in order; the report (`num_cached_tokens`: what the
        cache served the request, so the rest of the most kept was written by it)."""
        kept: list[int] = []
        expiries: list[float] = []
        pin = error = None
        prompt = seq.prompt_token_ids
        for keep in (k for k in seq.keeps if not k.reply):
            prefix = prompt[: keep.num_tokens]
            if keep.lock:
                try:
                    pin = self._pins.pin(prefix, seq.salt, seq.owner, keep.ttl_s)
                except InvalidRequest as refused:
                    error, pin = refused, None
                    kept.append(0)
                    continue
                kept.append(pin.num_pinned_tokens)
                if pin.expires_at_s is not None:
                    expiries.append(pin.expires_at_s)
                continue
            assert keep.ttl_s is not None, "Keep.check refuses an unlocked keep without a ttl"
            num = self._kv.retain(prefix, seq.salt, float(keep.ttl_s), seq.owner, self._max_retained_pages_per_owner) if prefix else 0
            kept.append(num)
            if num:
                expiries.append(self._clock() + keep.ttl_s)
        most = max(kept, default=0)
        expires_at_s = max(expiries, default=None)
        epoch_s = None if expires_at_s is None else expires_at_s - self._clock() + time.time()
        return KeepReport(tuple(kept), max(0, most - num_cached_tokens), expires_at_s, pin, error, epoch_s)

    def finish(self, seq: SequenceState, output: RequestOutput) -> None:
        """seq's request finished with `output`: retain its reply keep (a session's newest turn:
        the prompt's first num_tokens, then the first continuation's reply) for its ttl, where
        the session book makes room (its owner, its session caps); the book hears what was kept."""
        for keep in (k for k in seq.keeps if k.reply):
            assert keep.ttl_s is not None, "Keep.check refuses a reply keep without a ttl"
            reply = output.outputs[0].token_ids if output.outputs else []
            tokens = [*seq.prompt_token_ids[: keep.num_tokens], *reply]
            room = self._turns.room(seq.request_id, len(tokens), output.num_cached_tokens) if self._turns is not None else None
            if room is None:
                continue  # its session was released while the turn ran: the release stands
            if room.final:
                self._turns.ended(seq.request_id, tokens, seq.salt)  # type: ignore[union-attr]
                continue
            tokens = tokens[: room.num_tokens]
            cap = self._max_retained_pages_per_owner
            num = self._kv.retain(tokens, seq.salt, float(keep.ttl_s), room.owner, cap) if tokens else 0
            self._turns.kept(seq.request_id, self._tree.retentions(room.owner)[-1] if num else None, num)  # type: ignore[union-attr]
            if num:
                output.kept = self._with_turn(output.kept, num, self._clock() + keep.ttl_s)

    def _with_turn(self, report: KeepReport | None, num_tokens: int, expires_at_s: float) -> KeepReport:
        """The output's report with the turn just kept (before the output leaves the engine), so
        usage echoes what the next turn will find kept and until when."""
        report = report or KeepReport((), 0, None)
        latest = max(expires_at_s, report.expires_at_s or expires_at_s)
        epoch_s = latest - self._clock() + time.time()
        return replace(report, num_turn_tokens=num_tokens, expires_at_s=latest, expires_at_epoch_s=epoch_s)
