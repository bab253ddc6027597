"""Pins: prefixes locked against eviction, who made each, when it expires, and the caps that keep
pins from starving requests (per owner, over all owners, and room for a full-context request).
Must stay true: pinned pages never pass the caps, and a request the engine accepts fits beside them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixkv.errors import InvalidRequest, OwnerCapExceeded

if TYPE_CHECKING:
    from radixkv.cache.radix import Node
    from radixkv.engine.kv_manager import KVManager

# Whose share of a per-owner cap (pins, retention) a pin, retention or request counts against:
# the caller's own partition, over HTTP the API key's (server.tenants.Tenants.owner), never a
# salt that mixes in a request's cache_salt, or rotating salts would buy a fresh share each
# time. None: in-process callers, one owner together.
Owner = str | None

# Pin ids are random below 2**53 (exact in any JSON number): a sequential id would tell a
# caller how many pins others made, and let it guess theirs.
_PIN_ID_BOUND = 1 << 53
# All pins together lock at most this share of the page pool unless EngineConfig sets a number.
MAX_PINNED_FRACTION = 0.5
# One owner's pins lock at most this share of the pool unless EngineConfig sets a number: half
# of what all pins may lock, so no one owner takes all the pin room, on a pool of any size (a
# fixed number is the whole pin room on a small pool and a sliver of a large one).
MAX_PINNED_FRACTION_PER_OWNER = 0.25
# A pin whose expiry is this close counts as expired. A timer that expires pins (the server's)
# fires once, and uvloop's timers count from the loop's cached millisecond clock, so they may
# fire a millisecond or two before time.monotonic() reaches the expiry: without the slack such
# a pin would stay until the next pin call.
_EXPIRY_SLACK_S = 0.05


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    """One pin: the only record of it (the engine's, the server's, the SDK's)."""

    pin_id: int
    num_pinned_tokens: int  # the prefix's full pages' worth of tokens locked
    num_prompt_tokens: int  # the prefix's length as given
    node: Node  # the tree node whose path is locked (to unlock)
    owner: Owner  # whose cap it counts against
    expires_at_s: float | None  # time.monotonic() seconds; None: until unpinned


class Pins:
    """Every pin, its owner and expiry. Only its owner may see or release a pin (another
    owner's id answers as an unknown one, so ids reveal nothing); each owner locks at most
    `max_pages_per_owner`, all owners together at most `max_pages`. A pin that locks no page
    is refused, so pins cannot pile up uncounted. Expired pins go at the next call into this
    class (and whenever a caller runs `expire`). Touched only on the engine's thread."""

    def __init__(
        self,
        kv: KVManager,
        num_pages: int,
        page_size: int,
        max_context_tokens: int,
        max_pages: int | None = None,
        max_pages_per_owner: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kv = kv
        self._num_pages = num_pages
        self._page_size = page_size
        # Pinned pages are never evicted: leave room for a request of the whole context, or a
        # request the engine accepted could wait forever for pages no one will give back
        # (overlapping pins count twice: a safe over-estimate).
        context_pages = -(-max_context_tokens // page_size)
        default_max = max(0, min(int(num_pages * MAX_PINNED_FRACTION), num_pages - context_pages))
        self.max_pages = default_max if max_pages is None else max_pages
        self.max_pages_per_owner = (
            max(1, int(num_pages * MAX_PINNED_FRACTION_PER_OWNER)) if max_pages_per_owner is None else max_pages_per_owner
        )
        self._clock = clock
        self._records: dict[int, PinnedPrefix] = {}
        self.pages = 0  # pages all pins lock, overlaps counted twice
        # No pin expires before this: expire() runs every step, and scans the pins only past it.
        self._next_expiry_s = float("inf")

    def __bool__(self) -> bool:
        return bool(self._records)

    def pin(self, prompt: list[int], salt: str | None, owner: Owner, ttl_s: float | None) -> PinnedPrefix:
        """Lock the cached full blocks of `prompt` (in partition `salt`) for `owner`, until
        unpinned or, with a ttl, until then; InvalidRequest (OwnerCapExceeded for the owner's
        own cap) if it locks nothing or passes a cap, having locked nothing."""
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 <= ttl_s < float("inf")):
            raise InvalidRequest(f"a pin ttl must be a non-negative number of seconds, got {ttl_s!r}", param="ttl")
        self.expire()
        node, num_pinned_tokens = self._kv.pin(prompt, salt)
        pages = num_pinned_tokens // self._page_size
        try:
            self._check(pages, owner)
        except InvalidRequest:
            self._kv.unpin(node)
            raise
        pin_id = secrets.randbelow(_PIN_ID_BOUND - 1) + 1
        while pin_id in self._records:
            pin_id = secrets.randbelow(_PIN_ID_BOUND - 1) + 1
        expires_at_s = self._clock() + ttl_s if ttl_s else None
        record = PinnedPrefix(pin_id, num_pinned_tokens, len(prompt), node, owner, expires_at_s)
        self._records[pin_id] = record
        self.pages += pages
        if expires_at_s is not None:
            self._next_expiry_s = min(self._next_expiry_s, expires_at_s)
        return record

    def _check(self, pages: int, owner: Owner) -> None:
        if pages == 0:
            raise InvalidRequest(
                f"the prefix holds no full page of {self._page_size} tokens (or none is cached), so there is nothing to pin",
                param="prompt",
                code="nothing_to_pin",
            )
        if self.pages + pages > self.max_pages:
            raise InvalidRequest(
                f"pinning this prefix would lock {self.pages + pages} KV pages in all; the engine allows at most "
                f"{self.max_pages} pinned pages (of {self._num_pages}); unpin others first",
                code="pin_limit_exceeded",
                limit=self.max_pages,
            )
        held = sum(r.num_pinned_tokens for r in self._records.values() if r.owner == owner) // self._page_size
        if held + pages > self.max_pages_per_owner:
            raise OwnerCapExceeded(
                f"this owner's pins would lock {held + pages} KV pages; each owner (API key) may pin at most "
                f"{self.max_pages_per_owner} (of {self._num_pages}); unpin others first",
                code="pin_limit_exceeded",
                limit=self.max_pages_per_owner,
            )

    def unpin(self, pin_id: int, owner: Owner) -> bool:
        """Release `owner`'s pin; False if it is unknown, expired or another owner's."""
        self.expire()
        record = self._records.get(pin_id)
        if record is None or record.owner != owner:
            return False
        self._release(pin_id)
        return True

    def owned_by(self, owner: Owner) -> list[PinnedPrefix]:
        """`owner`'s live pins, oldest first; changes nothing but expiring pins past their ttl."""
        self.expire()
        return [r for r in self._records.values() if r.owner == owner]

    def expire(self) -> int:
        """Release every pin past its ttl; how many were."""
        now = self._clock() + _EXPIRY_SLACK_S
        if now < self._next_expiry_s:
            return 0
        expired = [pin_id for pin_id, r in self._records.items() if r.expires_at_s is not None and r.expires_at_s <= now]
        for pin_id in expired:
            self._release(pin_id)
        self._next_expiry_s = min((r.expires_at_s for r in self._records.values() if r.expires_at_s is not None), default=float("inf"))
        return len(expired)

    def _release(self, pin_id: int) -> None:
        record = self._records.pop(pin_id)
        self.pages -= record.num_pinned_tokens // self._page_size
        self._kv.unpin(record.node)

    def check_room(self, prompt: list[int], pages: int, salt: str | None) -> None:
        """InvalidRequest unless a request of `pages` pages for `prompt` fits beside the pinned
        pages; changes nothing. The pinned blocks it starts with are its own and do not count
        against it."""
        pinned: set[int] = set()
        for record in self._records.values():
            node: Node | None = record.node
            while node is not None:
                pinned.update(node.pages)
                node = node.parent
        shared = sum(1 for page in self._kv.peek_prefix(prompt, salt).pages if page in pinned)
        room = self._num_pages - len(pinned)
        if pages - shared > room:
            raise InvalidRequest(
                f"the request needs up to {pages - shared} KV pages besides pinned ones, but pins hold {len(pinned)} "
                f"of the pool's {self._num_pages}, leaving {room}; unpin a prefix or send a shorter request",
                param="prompt",
                limit=room,
            )
