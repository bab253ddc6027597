"""ParseSlots: parsing, templating and tokenizing a body run on worker threads, a few per API key
at once, so one key's flood of large or slow bodies cannot occupy every thread of the pool while
the other keys' requests wait for one; and within a CPU-time share per key, so one key sending
body after large body cannot keep a core (and the interpreter lock the engine needs) busy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio.to_thread

from radixkv.server.errors import rate_limited

T = TypeVar("T")

# Seconds a refused client is told to wait: a parse takes milliseconds to a second or so.
_RETRY_AFTER_S = 1


@dataclass(slots=True)
class _KeySlots:
    semaphore: asyncio.Semaphore
    users: int = 0  # parses running or waiting for this key's semaphore


@dataclass(slots=True)
class _CpuDebt:
    """A key's parse CPU seconds not yet paid off; paid off at the key's share per second."""

    seconds: float = 0.0
    at_s: float = 0.0  # time.monotonic() it was last brought up to date

    def settle(self, now_s: float, share: float) -> float:
        self.seconds = max(0.0, self.seconds - (now_s - self.at_s) * share)
        self.at_s = now_s
        return self.seconds


@dataclass(slots=True)
class ParseSlots:
    """Per key (None: the anonymous caller), at most `per_key` parses on threads at once; more
    wait on the event loop, holding no thread, up to `max_waiting` per key, past which a parse
    is refused with 429 and Retry-After. Waiting, not refusing at once, keeps a well-behaved
    client's burst served (its parses queue behind its own); the bound keeps a flood's waiting
    bodies finite. `per_key` 0: a quarter of the thread pool, at least 1. Event loop only.

    A key's parses also spend CPU time within `cpu_share` seconds per second, past a burst of
    `cpu_burst_s`: a parse starts only once the key's earlier parses are paid off down to the
    burst, waiting on the event loop meanwhile. A well-behaved key's parses take milliseconds
    and never wait; a key sending 1.6 MB bodies back to back (0.2 s of parsing each, holding
    the interpreter lock) is slowed to its share instead of slowing the engine. 0: no share."""

    per_key: int = 0
    max_waiting: int = 256
    limiter: anyio.CapacityLimiter | None = None  # None: anyio's default pool (its run_sync's)
    cpu_share: float = 0.25
    cpu_burst_s: float = 2.0
    _keys: dict[bytes | None, _KeySlots] = field(default_factory=dict)
    _debts: dict[bytes | None, _CpuDebt] = field(default_factory=dict)

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
            raise rate_limited(
                f"this API key has {slots.users} request bodies being parsed or waiting to be; the server parses "
                f"{self.limit()} per key at once and queues {self.max_waiting} more; retry later",
                _RETRY_AFTER_S,
            )
        slots.users += 1
        try:
            await self._pay_off(key)
            async with slots.semaphore:
                return await anyio.to_thread.run_sync(self._charged(key, fn), limiter=self.limiter)
        finally:
            slots.users -= 1
            if slots.users == 0:
                del self._keys[key]

    async def _pay_off(self, key: bytes | None) -> None:
        """Wait (on the event loop, no thread held) until `key`'s debt is within the burst."""
        if self.cpu_share <= 0:
            return
        while True:
            debt = self._debts.get(key)
            if debt is None:
                return
            owed = debt.settle(time.monotonic(), self.cpu_share)
            if owed == 0.0:
                del self._debts[key]  # paid off: nothing kept for keys that stopped sending
                return
            if owed <= self.cpu_burst_s:
                return
            await asyncio.sleep((owed - self.cpu_burst_s) / self.cpu_share)

    def charge(self, key: bytes | None, cpu_s: float) -> None:
        """Add CPU seconds `key` spent elsewhere on the server (its grammar compiles, in worker
        processes) to its debt, so its next parses wait for them as for its own parses'."""
        if self.cpu_share <= 0 or cpu_s <= 0:
            return
        debt = self._debts.setdefault(key, _CpuDebt(at_s=time.monotonic()))
        debt.seconds += cpu_s

    def _charged(self, key: bytes | None, fn: Callable[[], T]) -> Callable[[], T]:
        """fn, adding the CPU time its thread spends to `key`'s debt (failed parses count too)."""
        if self.cpu_share <= 0:
            return fn

        def run() -> T:
            start_s = time.thread_time()
            try:
                return fn()
            finally:
                spent_s = time.thread_time() - start_s
                # Dict and float updates are atomic under the interpreter lock; the event loop
                # reads them only between its own steps.
                debt = self._debts.setdefault(key, _CpuDebt(at_s=time.monotonic()))
                debt.seconds += spent_s

        return run
