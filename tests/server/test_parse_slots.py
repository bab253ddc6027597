"""Parsing runs on worker threads a few per key (radixkv.server.guards.parse_slots): a key holding
every parse it may have in flight leaves the other threads to the other keys, its further
parses wait without a thread, and past the waiting bound it gets 429 with Retry-After."""

from __future__ import annotations

import asyncio
import time
import threading

import anyio
import pytest

from radixkv.server.errors import APIError
from radixkv.server.guards.parse_slots import ParseSlots
from radixkv.server.limits import ServerLimits


class Blocker:
    """A parse that holds its thread until released, counting how many run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.running = 0
        self.peak = 0

    def __call__(self) -> str:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            self.release.wait(60)
        finally:
            with self._lock:
                self.running -= 1
        return "a"


async def _until(condition, timeout_s: float = 30.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def test_one_key_at_its_cap_does_not_stop_another_keys_parse() -> None:
    async def main() -> None:
        # A pool of 4 threads: without per-key slots, key a's 10 parses would take all 4 and
        # key b's parse would wait for one of them to end (here: never, until released).
        slots = ParseSlots(per_key=2, max_waiting=100, limiter=anyio.CapacityLimiter(4))
        blocker = Blocker()
        tasks = [asyncio.create_task(slots.run(b"a", blocker)) for _ in range(10)]
        await _until(lambda: blocker.running == 2 and slots.in_use(b"a") == 10)
        with anyio.fail_after(30):
            assert await slots.run(b"b", lambda: "b") == "b"
        assert blocker.peak == 2  # the other 8 wait, holding no thread
        blocker.release.set()
        assert await asyncio.gather(*tasks) == ["a"] * 10
        assert blocker.peak == 2 and slots.in_use(b"a") == 0 and slots.in_use(b"b") == 0

    asyncio.run(main())


def test_past_the_waiting_bound_a_key_gets_429_with_retry_after() -> None:
    async def main() -> None:
        slots = ParseSlots(per_key=1, max_waiting=2, limiter=anyio.CapacityLimiter(4))
        blocker = Blocker()
        tasks = [asyncio.create_task(slots.run(b"a", blocker)) for _ in range(3)]
        await _until(lambda: blocker.running == 1 and slots.in_use(b"a") == 3)
        with pytest.raises(APIError) as refused:
            await slots.run(b"a", lambda: "x")
        assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
        assert await slots.run(None, lambda: "anonymous") == "anonymous"  # others unaffected
        blocker.release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_the_default_is_a_quarter_of_the_pool() -> None:
    async def main() -> None:
        assert ParseSlots(limiter=anyio.CapacityLimiter(40)).limit() == 10
        assert ParseSlots(limiter=anyio.CapacityLimiter(2)).limit() == 1
        assert ParseSlots(per_key=3).limit() == 3

    asyncio.run(main())


def test_every_route_parses_through_the_slots(live_server) -> None:
    # The server's slots come from its limits; a request leaves none held behind it.
    slots = live_server.app.state.radixkv.parse_slots
    assert slots.max_waiting == ServerLimits().max_requests_per_key
    with live_server.http() as client:
        for path, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
            ("/v1/messages", {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ]:
            assert client.post(path, json=body).status_code == 200
    assert slots._keys == {}


def _burn_cpu(seconds: float) -> str:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass
    return "burnt"


def test_a_key_past_its_cpu_share_waits_while_another_key_parses_at_once() -> None:
    async def main() -> None:
        # A share of 0.01 CPU-seconds a second past a 0.01 s burst: after 0.1 s of parsing,
        # key a owes about 9 s before its next parse may start; key b owes nothing.
        slots = ParseSlots(per_key=2, limiter=anyio.CapacityLimiter(4), cpu_share=0.01, cpu_burst_s=0.01)
        assert await slots.run(b"a", lambda: _burn_cpu(0.1)) == "burnt"
        assert slots._debts[b"a"].seconds >= 0.1  # the thread's CPU time, charged to its key
        started = asyncio.Event()
        waiting = asyncio.create_task(slots.run(b"a", started.set))
        assert await slots.run(b"b", lambda: "b") == "b"  # another key is never held up
        await asyncio.sleep(0.3)
        assert not started.is_set() and slots.in_use(b"a") == 1  # waits, holding no thread
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert slots.in_use(b"a") == 0

    asyncio.run(main())


def test_without_a_share_nothing_is_charged() -> None:
    async def main() -> None:
        slots = ParseSlots(per_key=1, limiter=anyio.CapacityLimiter(2), cpu_share=0.0)
        for _ in range(3):
            assert await slots.run(b"a", lambda: _burn_cpu(0.02)) == "burnt"
        assert slots._debts == {}

    asyncio.run(main())
