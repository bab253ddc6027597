"""The load test's abusive clients (scenarios/load_test.py --abuse), run in a process of their
own: a key flooding past its share, oversized bodies, slow readers, requests carrying what no
request may, a flood of stored Responses, and the doors' attacks (scenarios/abuse_doors.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from radixkv.scenarios.abuse_doors import DoorTally, door_attacks
from radixkv.scenarios.harness import TEXT


@dataclass(slots=True)
class AbuseTally:
    """What the abusive clients sent and what they got."""

    flood_sent: int = 0
    flood_refused_429: int = 0
    flood_other: int = 0
    oversized_sent: int = 0
    oversized_refused_413: int = 0
    oversized_cut_off: int = 0  # refused by closing the connection before the body was all sent
    slow_readers: int = 0
    # Requests carrying what no request may: each must get a 4xx, quickly, costing no one else.
    many_tools_sent: int = 0
    many_tools_refused: int = 0
    breakpoints_sent: int = 0
    breakpoints_refused: int = 0
    dead_schema_sent: int = 0
    dead_schema_refused: int = 0
    # Retention under a fresh cache_salt each time: served, but retained within one owner's cap.
    salt_rotations_sent: int = 0
    salt_rotations_other: int = 0  # answers that were neither 200 nor 429
    retained_pages_end: int = 0
    retained_pages_cap: int = 0  # the abuser's cap plus what the well-behaved key retained
    # Stored Responses from the abuser: a well-behaved key's stored response must outlive them.
    store_flood_sent: int = 0
    store_flood_other: int = 0
    well_retained_tokens: tuple[int, int] = (0, 0)  # its retained prefix's cached tokens, before and after
    well_retained_kept: bool = False  # the well-behaved key's retained prefix still cached
    well_stored_kept: bool = False  # its stored response still continues
    doors: DoorTally = field(default_factory=DoorTally)

    @property
    def request_attacks_ok(self) -> bool:
        return (
            self.many_tools_refused == self.many_tools_sent
            and self.breakpoints_refused == self.breakpoints_sent
            and self.dead_schema_refused == self.dead_schema_sent
            and self.salt_rotations_other == 0
            and self.store_flood_other == 0
            and self.retained_pages_end <= self.retained_pages_cap
            and self.well_retained_kept
            and self.well_stored_kept
            and self.doors.ok
        )


async def flood(base_url: str, key: str, body: dict[str, Any], concurrency: int, stop: asyncio.Event, tally: AbuseTally) -> None:
    """One key keeping `concurrency` requests in flight until `stop`: most should get 429."""
    headers = {"Authorization": f"Bearer {key}"}

    async def one_lane(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            tally.flood_sent += 1
            try:
                response = await client.post("/v1/completions", json=body, headers=headers)
            except httpx.HTTPError:
                tally.flood_other += 1
                continue
            if response.status_code == 429:
                tally.flood_refused_429 += 1
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")) / 10)  # an impatient client
            elif response.status_code != 200:
                tally.flood_other += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        await asyncio.gather(*(one_lane(client) for _ in range(concurrency)))


async def oversized(base_url: str, key: str, count: int, max_body_bytes: int, tally: AbuseTally) -> None:
    """Bodies one byte past the limit: each must be refused (413) without being processed."""
    body = json.dumps({"prompt": "x" * max_body_bytes, "max_tokens": 1}).encode()
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for _ in range(count):
            tally.oversized_sent += 1
            try:
                response = await client.post(
                    "/v1/completions", content=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
                )
            except httpx.TimeoutException:
                continue
            except httpx.TransportError:
                # The server answered 413 and closed while the body was still going out.
                tally.oversized_cut_off += 1
                continue
            # 429: the key's share is in flight (its own flood), refused unread as well.
            tally.oversized_refused_413 += response.status_code in (413, 429)


# A string only raw control bytes could continue: the grammar has no way on after `{"a":"`.
DEAD_END_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "\u0001+"}}, "required": ["a"]}


async def request_attacks(base_url: str, key: str, model_name: str, args: argparse.Namespace, stop: asyncio.Event, tally: AbuseTally) -> None:
    """One lane of requests that carry what no request may (refused with a 4xx each), and
    retention under a new cache_salt each time (served, capped per owner), round robin until `stop`."""
    headers = {"Authorization": f"Bearer {key}"}
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(args.many_tools)]
    ask = [{"role": "user", "content": "Hi"}]
    # Encoded once: the attacker's cost of a request should not be what the run measures.
    many_tools = json.dumps({"model": model_name, "messages": ask, "tools": tools, "max_tokens": 1}).encode()
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(args.breakpoints)]
    dead_end = {"type": "json_schema", "json_schema": {"name": "dead_end", "schema": DEAD_END_SCHEMA}}
    headers["Content-Type"] = "application/json"
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers) as client:
        for i in itertools.count():
            # Every attack at least once, however short the run; the dead-end schema until one was
            # answered (its 429s are no answer, and the key's own flood may hold its share until stop).
            if stop.is_set() and i >= 4 and (tally.dead_schema_sent or i >= 400):
                return
            kind = i % 4
            try:
                if kind == 0:
                    tally.many_tools_sent += 1
                    response = await client.post("/v1/chat/completions", content=many_tools)
                    tally.many_tools_refused += 400 <= response.status_code < 500
                elif kind == 1:
                    tally.breakpoints_sent += 1
                    body = {"model": model_name, "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}
                    response = await client.post("/v1/messages", json=body)
                    tally.breakpoints_refused += 400 <= response.status_code < 500
                elif kind == 2:
                    tally.dead_schema_sent += 1
                    body = {"model": model_name, "messages": ask, "response_format": dead_end, "max_tokens": 64}
                    response = await client.post("/v1/chat/completions", json=body)
                    # A 429 (the key's share taken by its own flood) is no answer: not counted.
                    tally.dead_schema_sent -= response.status_code == 429
                    tally.dead_schema_refused += response.status_code == 400
                else:
                    tally.salt_rotations_sent += 1
                    body = {"model": model_name, "prompt": f"Retain {i}: " + TEXT[:300], "max_tokens": 1,
                            "prompt_cache_retention": "24h", "cache_salt": secrets.token_hex(8)}  # fmt: skip
                    response = await client.post("/v1/completions", json=body)
                    tally.salt_rotations_other += response.status_code not in (200, 429)
            except httpx.HTTPError:
                tally.salt_rotations_other += kind == 3  # the refusals count as not refused
            await asyncio.sleep(0)


async def store_flood(base_url: str, key: str, model_name: str, count: int, stop: asyncio.Event, tally: AbuseTally) -> None:
    """`count` stored Responses from one key, a few lanes at a time: none may push out another
    tenant's stored response."""
    headers = {"Authorization": f"Bearer {key}"}
    remaining = iter(range(count))

    async def lane(client: httpx.AsyncClient) -> None:
        for i in remaining:
            if stop.is_set():
                return
            tally.store_flood_sent += 1
            body = {"model": model_name, "input": f"Store {i}", "max_output_tokens": 1, "store": True}
            try:
                response = await client.post("/v1/responses", json=body)
            except httpx.HTTPError:
                tally.store_flood_other += 1
                continue
            if response.status_code == 429:
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")) / 10)
            elif response.status_code != 200:
                tally.store_flood_other += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers) as client:
        await asyncio.gather(*(lane(client) for _ in range(4)))


@dataclass(slots=True)
class WellKeyState:
    """What one well-behaved key kept before the abuse: a retained prefix and a stored response."""

    retained_prompt: str
    retained_tokens: int
    stored_response_id: str


def keep_before_abuse(base_url: str, key: str, model_name: str) -> WellKeyState:
    prompt = "Kept by a well-behaved key: " + TEXT[:400]
    with httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "prompt_cache_retention": "24h"}
        client.post("/v1/completions", json=body).raise_for_status()
        cached = client.post("/v1/cache/lookup", json={"prompt": prompt}).raise_for_status().json()["ram_tokens"]
        stored = client.post("/v1/responses", json={"model": model_name, "input": "Remember me.", "max_output_tokens": 1, "store": True})
        return WellKeyState(prompt, cached, stored.raise_for_status().json()["id"])


def check_after_abuse(base_url: str, key: str, model_name: str, kept: WellKeyState, tally: AbuseTally) -> None:
    with httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        cached = client.post("/v1/cache/lookup", json={"prompt": kept.retained_prompt}).json().get("ram_tokens", 0)
        tally.well_retained_tokens = (kept.retained_tokens, cached)
        tally.well_retained_kept = kept.retained_tokens > 0 and cached >= kept.retained_tokens
        body = {"model": model_name, "input": "Still there?", "max_output_tokens": 1, "previous_response_id": kept.stored_response_id}
        tally.well_stored_kept = client.post("/v1/responses", json=body).status_code == 200


def open_slow_readers(base_url: str, key: str, body: dict[str, Any], count: int, tally: AbuseTally) -> list[Any]:
    """Streaming requests on sockets that never read (a small receive window): the server must
    abort them after its send timeout rather than hold their output."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sockets = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(head + payload)
        sockets.append(sock)
        tally.slow_readers += 1
    return sockets


def abuse_in_own_process(base_url: str, abuser_keys: tuple[str, str], model_name: str, options: dict, stop: Any, results: Any) -> None:
    """The abusive clients until `stop` (a multiprocessing Event), then their tally on `results`."""
    import os

    os.nice(10)  # the abusers' own CPU is not the server's to defend
    results.put(asyncio.run(_abuse(base_url, abuser_keys, model_name, argparse.Namespace(**options), stop)))


async def _abuse(base_url: str, abuser_keys: tuple[str, str], model_name: str, args: argparse.Namespace, outer_stop: Any) -> dict[str, Any]:
    """The first abusive key floods, reads nothing and sends oversized bodies; the second sends
    what no request may carry and stores Responses by the thousand (below its share, so its
    requests reach the caps rather than the first key's 429s)."""
    flooder, prober = abuser_keys
    tally = AbuseTally()
    stop = asyncio.Event()
    flood_body = {"model": model_name, "prompt": "Flood: " + TEXT[:120], "max_tokens": args.max_tokens, "temperature": 0}
    flooding = asyncio.create_task(flood(base_url, flooder, flood_body, args.flood_concurrency, stop, tally))
    too_big = asyncio.create_task(oversized(base_url, flooder, args.oversized, args.max_body_bytes, tally))
    attacks = asyncio.create_task(request_attacks(base_url, prober, model_name, args, stop, tally))
    storing = asyncio.create_task(store_flood(base_url, prober, model_name, args.store_flood, stop, tally))
    doors = asyncio.create_task(door_attacks(base_url, prober, args.victim_key, model_name, args.echoes, stop, tally.doors))
    await asyncio.to_thread(outer_stop.wait)
    await storing
    stop.set()
    await asyncio.gather(flooding, too_big, attacks, doors)
    return asdict(tally)
