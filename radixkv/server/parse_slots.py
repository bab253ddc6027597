"""ParseSlots: parsing, templating and tokenizing a body run on worker threads, a few per API key
at once, so one key's flood of large or slow bodies cannot occupy every thread of the pool while
the other keys' requests wait for one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio.to_thread

from radixkv.server.errors import APIError

T = TypeVar("T")

# Seconds a refused client is told to wait: a parse takes milliseconds to a second or so.
_RETRY_AFTER_S = 1


@dataclass(slots=True)
class _KeySlots:
    semaphore: asyncio.Semaphore
    users: int = 0  # parses running or waiting for this key's semaphore


@dataclass(slots=True)
class ParseSlots:
    """Per key (None: the anonymous caller), at most `per_key` parses on threads at once; more
    wait on the event loop, holding no thread, up to `max_waiting` per key, past which a parse
    is refused with 429 and Retry-After. Waiting, not refusing at once, keeps a well-behaved
    client's burst served (its parses queue behind its own); the bound keeps a flood's waiting
    bodies finite. `per_key` 0: a quarter of the thread pool, at least 1. Event loop only."""

    per_key: int = 0
    max_waiting: int = 256
    limiter: anyio.CapacityLimiter | None = None  # None: anyio's default pool (its run_sync's)
    _keys: dict[bytes | None, _KeySlots] = field(default_factory=dict)

    def limit(self) -> int:
        if self.per_key > 0:
            return self.per_key
        pool = self.limiter or anyio.to_thread.current_default_thread_limiter()
        return max(1, int(pool.total_tokens) // 4)

    def in_use(self, key: bytes | None) -> int:
        """Parses of `key` running or waiting (for tests and metrics)."""
        slots = self._keys.get(key)
        return slots.users if slots else 0

    async def run(self, key: bytes | None, fn: Callable[[], T]) -> T:
        """fn() on a worker thread once one of `key`'s slots is free."""
        slots = self._keys.get(key)
        if slots is None:
            slots = self._keys[key] = _KeySlots(asyncio.Semaphore(self.limit()))
        if slots.users >= self.limit() + self.max_waiting:
            raise APIError(
                429,
                f"this API key has {slots.users} request bodies being parsed or waiting to be; the server parses "
                f"{self.limit()} per key at once and queues {self.max_waiting} more; retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(_RETRY_AFTER_S)},
            )
        slots.users += 1
        try:
            async with slots.semaphore:
                return await anyio.to_thread.run_sync(fn, limiter=self.limiter)
        finally:
            slots.users -= 1
            if slots.users == 0:
                del self._keys[key]
