"""Stored responses for `previous_response_id`: each one's whole conversation as chat messages
(instructions left out, as OpenAI does not carry them over) and, for exact continuation, the
turn's token ids (its prompt, then its reply as generated), kept in memory per owner (an API
key's Tenants.owner), each for at most `ttl_s` after it was made, within a count and a byte cap
per owner and over all owners; one owner's stores never push out another's within its caps.
"""

from __future__ import annotations

import json
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STORED_RESPONSE_TTL_S = 3600.0


TOKEN_BYTES = 4  # a stored token id's size (int32), what the byte caps count for it


@dataclass(frozen=True, slots=True)
class TurnIds:
    """A turn's ids as the engine saw and made them, for the next turn to continue from."""

    token_ids: array  # int32: the turn's prompt, then its reply's ids as generated
    num_reply_tokens: int  # the reply's ids at the end (they decode to its text exactly)
    context_key: str  # the instructions and tools its prompt was rendered with (a change re-renders)

    @property
    def num_bytes(self) -> int:
        return len(self.token_ids) * TOKEN_BYTES


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None  # the tenant (Tenants.owner of its key): a response is invisible to the others
    messages: tuple[dict[str, Any], ...]  # the conversation up to and including this response
    expires_at_s: float
    num_bytes: int  # the conversation's JSON size plus its ids', what the byte caps count
    ids: TurnIds | None = None  # None: the next turn re-renders the conversation from text


@dataclass(slots=True)
class _Holding:
    """One owner's stored responses, oldest first, and their bytes."""

    ids: OrderedDict[str, None]
    num_bytes: int = 0


def conversation_bytes(messages: list[dict[str, Any]]) -> int:
    """What a conversation counts against the byte caps: its size as JSON (UTF-8)."""
    return len(json.dumps(messages, ensure_ascii=False, default=str).encode())


class ResponseStore:
    """A bounded, expiring map of response id to conversation. Per owner at most
    `max_responses_per_owner` responses and `max_bytes_per_owner` bytes (past either, the
    owner's own oldest go); over all owners at most `max_responses` and `max_bytes` (past
    either, the owner holding the most bytes loses its oldest, so an owner within its share
    keeps its responses whoever else stores)."""

    def __init__(
        self,
        max_responses_per_owner: int = 1024,
        max_bytes_per_owner: int = 64 << 20,
        max_responses: int = 65536,
        max_bytes: int = 1 << 30,
        ttl_s: float = STORED_RESPONSE_TTL_S,
        clock: Callable[[], float] = time.monotonic,  # seconds; tests pass their own
    ) -> None:
        if min(max_responses_per_owner, max_bytes_per_owner, max_responses, max_bytes) < 1 or ttl_s <= 0:
            raise ValueError(
                "a response store needs room for one response and a positive ttl, got "
                f"{max_responses_per_owner}, {max_bytes_per_owner}, {max_responses}, {max_bytes}, {ttl_s}"
            )
        self.max_responses_per_owner = max_responses_per_owner
        self.max_bytes_per_owner = max_bytes_per_owner
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # all owners', oldest first
        self._owners: dict[str | None, _Holding] = {}  # an owner goes with its last response
        self._num_bytes = 0
        # Routes run on one event loop, but a store may be shared by apps in other threads.
        self._lock = threading.Lock()

    def put(self, response_id: str, owner: str | None, messages: list[dict[str, Any]], ids: TurnIds | None = None) -> bool:
        """Store a conversation (and its turn's ids, left out when they would put it over a
        byte cap: the next turn then re-renders); False (nothing stored) when the conversation
        alone is over the per-owner byte cap, which the route refuses up front
        (conversation_bytes) for what it can."""
        num_bytes = conversation_bytes(messages)
        if num_bytes > self.max_bytes_per_owner or num_bytes > self.max_bytes:
            return False
        if ids is not None and num_bytes + ids.num_bytes <= min(self.max_bytes_per_owner, self.max_bytes):
            num_bytes += ids.num_bytes
        else:
            ids = None
        entry = StoredResponse(owner, tuple(messages), self._clock() + self.ttl_s, num_bytes, ids)
        with self._lock:
            self._drop_expired()
            if response_id in self._entries:
                self._remove(response_id)
            holding = self._owners.get(owner)
            while holding is not None and holding.ids and (
                len(holding.ids) >= self.max_responses_per_owner or holding.num_bytes + num_bytes > self.max_bytes_per_owner
            ):
                self._remove(next(iter(holding.ids)))
            while self._entries and (len(self._entries) >= self.max_responses or self._num_bytes + num_bytes > self.max_bytes):
                largest = max(self._owners.values(), key=lambda h: (h.num_bytes, len(h.ids)))
                self._remove(next(iter(largest.ids)))
            self._entries[response_id] = entry
            self._owners.setdefault(owner, _Holding(OrderedDict())).ids[response_id] = None
            self._owners[owner].num_bytes += num_bytes
            self._num_bytes += num_bytes
        return True

    def get(self, response_id: str, owner: str | None) -> list[dict[str, Any]] | None:
        """The conversation ending in that response, or None: unknown, expired or another's."""
        with self._lock:
            self._drop_expired()
            entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return [dict(m) for m in entry.messages]

    def ids_of(self, response_id: str, owner: str | None) -> TurnIds | None:
        """The turn ids stored with that response, or None: none kept, unknown, expired or another's."""
        with self._lock:
            self._drop_expired()
            entry = self._entries.get(response_id)
        return None if entry is None or entry.owner != owner else entry.ids

    def held_by(self, owner: str | None) -> tuple[int, int]:
        """(responses, bytes) the owner has stored now."""
        with self._lock:
            self._drop_expired()
            holding = self._owners.get(owner)
            return (0, 0) if holding is None else (len(holding.ids), holding.num_bytes)

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._entries)

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        holding = self._owners[entry.owner]
        del holding.ids[response_id]
        holding.num_bytes -= entry.num_bytes
        self._num_bytes -= entry.num_bytes
        if not holding.ids:
            del self._owners[entry.owner]

    def _drop_expired(self) -> None:
        # Entries are in insertion order and share one ttl, so the expired ones lead.
        now = self._clock()
        while self._entries:
            response_id, first = next(iter(self._entries.items()))
            if first.expires_at_s > now:
                break
            self._remove(response_id)
