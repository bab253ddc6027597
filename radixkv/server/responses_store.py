"""Stored responses for `previous_response_id`: each one's whole conversation as chat messages
(instructions left out, as OpenAI does not carry them over), kept in memory per tenant, at most
`max_responses` of them, each for at most `ttl_s` after it was made.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024
STORED_RESPONSE_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None  # the tenant (an HMAC of its key): a response is invisible to the others
    messages: tuple[dict[str, Any], ...]  # the conversation up to and including this response
    expires_at_s: float


class ResponseStore:
    """A bounded, expiring map of response id to conversation; the oldest go first."""

    def __init__(
        self,
        max_responses: int = MAX_STORED_RESPONSES,
        ttl_s: float = STORED_RESPONSE_TTL_S,
        clock: Callable[[], float] = time.monotonic,  # seconds; tests pass their own
    ) -> None:
        if max_responses < 1 or ttl_s <= 0:
            raise ValueError(f"a response store needs room for one response and a positive ttl, got {max_responses}, {ttl_s}")
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # Routes run on one event loop, but a store may be shared by apps in other threads.
        self._lock = threading.Lock()

    def put(self, response_id: str, owner: str | None, messages: list[dict[str, Any]]) -> None:
        entry = StoredResponse(owner, tuple(messages), self._clock() + self.ttl_s)
        with self._lock:
            self._entries[response_id] = entry
            self._drop_expired()
            while len(self._entries) > self.max_responses:
                self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> list[dict[str, Any]] | None:
        """The conversation ending in that response, or None: unknown, expired or another's."""
        with self._lock:
            self._drop_expired()
            entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return [dict(m) for m in entry.messages]

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._entries)

    def _drop_expired(self) -> None:
        # Entries are in insertion order and share one ttl, so the expired ones lead.
        now = self._clock()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires_at_s > now:
                break
            self._entries.popitem(last=False)
