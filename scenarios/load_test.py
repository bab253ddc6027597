"""Bounded load test of the OpenAI-compatible server on 127.0.0.1.

Starts its own server in-process on a free loopback port, then runs `--clients` concurrent
streaming clients through `--requests` requests: groups sharing a long system prompt and
prompts that share nothing, some clients disconnecting mid-stream. Reports completed, failed
and aborted requests, p50/p99 latency and time to first token, as a table and as JSON, and
ends by checking that no request is left running and that the page accounting holds.

With --abuse the workload runs twice, spread over --well-keys API keys: alone, then beside
abusive clients (slow readers that stop reading, oversized bodies, one key flooding the
server, and one key sending what a request may not carry: 30,000 tools, dozens of
cache_control breakpoints, a JSON schema with no way on, retention under a new cache_salt
each time, and a flood of stored Responses; and the doors of scenarios/abuse_doors.py: echoed
replies around forged splice markers, grammar pairs beside another key's schema, lookups past
the context, a logit_bias key of 5,000 digits); the table reports, per well-behaved key,
completed / failed and p99 latency in both runs (the verdict wants the second at most
--max-p99-ratio times the first), what the abusers got (429s, 413s, 400s, aborts), that a
well-behaved key's retained prefix and stored response outlived the abuse, that the abuser
retained at most its cap, and 0 leaked pages, 0 requests left running.

    python -m radixkv.scenarios.load_test [--model DIR] [--clients 64] [--requests 200] [--max-tokens 16] [--abuse]

Every loop is bounded: by the request count, by --time-limit-s for starting requests, and by
--request-timeout-s for each request. Exit status 0 only when nothing failed and every check
passed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixkv.scenarios.abuse_doors import DoorTally, door_attacks
from radixkv.scenarios.harness import TEXT
from radixkv.server.thread import ServerThread

HOST = "127.0.0.1"  # loopback only, by design: this is a test, not a benchmark of a network
# For a model folder without a chat template (the tests' tiny models): the chat, Messages and
# Responses routes need one, and the abuse run sends to all three.
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(slots=True)
class Job:
    index: int
    path: str
    body: dict[str, Any]
    shared: bool
    disconnect_after_chunks: int | None  # None: read to the end
    key_index: int = 0  # which well-behaved API key sends it


@dataclass(slots=True)
class Outcome:
    index: int
    shared: bool
    status: str  # "completed", "failed", "aborted" (the client left on purpose)
    http_status: int | None = None
    error: str | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    key_index: int = 0


@dataclass(slots=True)
class KeyRow:
    """One well-behaved key's requests, alone and beside the abusive clients."""

    key_index: int
    completed: int
    failed: int
    p99_alone_s: float | None
    completed_with_abuse: int
    failed_with_abuse: int
    p99_with_abuse_s: float | None

    @property
    def p99_ratio(self) -> float | None:
        if not self.p99_alone_s or self.p99_with_abuse_s is None:
            return None
        return self.p99_with_abuse_s / self.p99_alone_s


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


@dataclass(slots=True)
class Report:
    model: str
    clients: int
    requests: int
    started: int
    completed: int
    failed: int
    aborted: int
    server_aborts: float
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    cached_token_fraction: float
    preemptions: int
    evicted_pages: int
    final_running: int
    final_waiting: int
    final_unfinished: int
    invariant_ok: bool
    invariant_error: str | None
    failures: list[str] = field(default_factory=list)
    keys: list[KeyRow] = field(default_factory=list)  # with --abuse only
    abuse: AbuseTally | None = None
    max_p99_ratio: float = 2.0

    @property
    def ok(self) -> bool:
        return (
            self.failed == 0
            and self.completed + self.aborted == self.requests
            and self.invariant_ok
            and self.final_running == self.final_waiting == self.final_unfinished == 0
            and self.abuse_ok
        )

    @property
    def abuse_ok(self) -> bool:
        """Abusers were refused and the well-behaved keys hardly noticed them."""
        if self.abuse is None:
            return True
        tally = self.abuse
        ratios_ok = all(row.p99_ratio is None or row.p99_ratio <= self.max_p99_ratio for row in self.keys)
        return (
            ratios_ok
            and all(row.failed_with_abuse == 0 for row in self.keys)
            and tally.oversized_refused_413 + tally.oversized_cut_off == tally.oversized_sent
            and (tally.flood_sent == 0 or tally.flood_refused_429 > 0)
            and tally.request_attacks_ok
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages; default: sized from memory")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="distinct shared system prompts")
    parser.add_argument("--system-len", type=int, default=192, help="tokens of each shared system prompt")
    parser.add_argument("--question-len", type=int, default=24, help="tokens of each question / distinct prompt")
    parser.add_argument("--shared-fraction", type=float, default=0.7, help="share of requests with a shared prefix")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1, help="share of clients that leave mid-stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="no request starts after this")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--check-invariants", action="store_true", help="engine checks its pages every step (slow)")
    parser.add_argument("--abuse", action="store_true", help="run again beside slow readers, oversized bodies and a flooding key")
    parser.add_argument("--well-keys", type=int, default=3, help="well-behaved API keys the requests are spread over")
    parser.add_argument("--flood-concurrency", type=int, default=160, help="requests the flooding key keeps in flight (past its share: see share in main)")
    parser.add_argument("--slow-readers", type=int, default=4, help="streaming clients that never read their answer")
    parser.add_argument("--slow-reader-tokens", type=int, default=256, help="max_tokens of each slow reader's request")
    parser.add_argument("--oversized", type=int, default=8, help="requests with a body past the server's limit")
    parser.add_argument("--many-tools", type=int, default=30_000, help="tools in each of the abuser's tool-flood requests")
    parser.add_argument("--breakpoints", type=int, default=64, help="cache_control breakpoints in each of the abuser's messages")
    parser.add_argument("--echoes", type=int, default=150, help="echoed replies in each of the abuser's splice requests")
    parser.add_argument("--store-flood", type=int, default=1100, help="stored Responses the abuser creates (past the old global 1,024)")
    parser.add_argument("--retain-cap", type=int, default=64, help="the engine's max_retained_pages_per_owner in this run")
    parser.add_argument("--max-body-bytes", type=int, default=2 << 20, help="the server's body limit in this run (30,000 tools fit under 2 MiB)")
    parser.add_argument("--stream-send-timeout-s", type=float, default=2.0, help="the server's slow-reader timeout in this run")
    parser.add_argument("--max-p99-ratio", type=float, default=2.0, help="well-behaved p99 with abuse / alone, at most")
    parser.add_argument("--out", default="out/load_test")
    args = parser.parse_args(argv)
    for name in ("clients", "requests", "max_tokens", "groups", "system_len", "question_len", "well_keys"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# -- the server ------------------------------------------------------------------------------


# -- the workload ----------------------------------------------------------------------------


def build_jobs(args: argparse.Namespace, tokenizer: Any, model_name: str) -> list[Job]:
    rng = random.Random(args.seed)
    words = TEXT.split()
    base = tokenizer(TEXT, add_special_tokens=False).input_ids

    def tokens(count: int, offset: int) -> list[int]:
        return [base[(offset + i) % len(base)] for i in range(count)]

    systems = [tokenizer.decode(tokens(args.system_len, 97 * g)) for g in range(args.groups)]
    chat = bool(getattr(tokenizer, "chat_template", None))
    jobs = []
    for i in range(args.requests):
        shared = rng.random() < args.shared_fraction
        # A distinct opening (the request number) keeps unshared prompts from sharing a block.
        question = f"Request {i}: " + " ".join(rng.choice(words) for _ in range(max(1, args.question_len // 2)))
        if shared:
            system = systems[rng.randrange(args.groups)]
            if chat:
                path = "/v1/chat/completions"
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                body: dict[str, Any] = {"messages": messages}
            else:
                path, body = "/v1/completions", {"prompt": system + "\n" + question}
        else:
            path, body = "/v1/completions", {"prompt": question}
        body.update(
            model=model_name,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        leave = rng.random() < args.disconnect_fraction
        jobs.append(Job(i, path, body, shared, rng.randint(1, 3) if leave else None, i % args.well_keys))
    return jobs


def salted(jobs: list[Job], salt: str) -> list[Job]:
    """The same jobs in their own cache partition, so a second run finds nothing the first cached."""
    return [Job(j.index, j.path, {**j.body, "cache_salt": salt}, j.shared, j.disconnect_after_chunks, j.key_index) for j in jobs]


async def run_one(client: httpx.AsyncClient, job: Job, headers: dict[str, str]) -> Outcome:
    outcome = Outcome(job.index, job.shared, "failed", key_index=job.key_index)
    start = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", job.path, json=job.body, headers=headers) as response:
            outcome.http_status = response.status_code
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    outcome.status = "completed"
                    outcome.latency_s = time.perf_counter() - start
                    return outcome
                event = json.loads(data)
                if "error" in event:
                    outcome.error = f"stream error: {event['error']}"
                    return outcome
                if event.get("usage"):
                    usage = event["usage"]
                    outcome.completion_tokens = usage["completion_tokens"]
                    outcome.prompt_tokens = usage["prompt_tokens"]
                    outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        if outcome.ttft_s is None:
                            outcome.ttft_s = time.perf_counter() - start
                if job.disconnect_after_chunks is not None and chunks >= job.disconnect_after_chunks:
                    outcome.status = "aborted"  # leaving the block drops the connection
                    return outcome
            outcome.error = "the stream ended without [DONE]"
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


async def run_clients(
    base_url: str, api_keys: list[str], jobs: list[Job], args: argparse.Namespace
) -> tuple[list[Outcome], float]:
    queue = list(reversed(jobs))
    outcomes: list[Outcome] = []
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    start = time.perf_counter()
    deadline = start + args.time_limit_s

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue and time.perf_counter() < deadline:
            job = queue.pop()
            headers = {"Authorization": f"Bearer {api_keys[job.key_index]}"}
            try:
                outcome = await asyncio.wait_for(run_one(client, job, headers), args.request_timeout_s)
            except TimeoutError:
                outcome = Outcome(job.index, job.shared, "failed", error=f"no answer in {args.request_timeout_s} s", key_index=job.key_index)
            outcomes.append(outcome)
            done = len(outcomes)
            if done % max(1, len(jobs) // 10) == 0:
                print(f"  {done}/{len(jobs)} requests done ({time.perf_counter() - start:.0f} s)", flush=True)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
    return outcomes, time.perf_counter() - start


# -- the abusive clients ---------------------------------------------------------------------


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
            if stop.is_set() and i >= 4:  # every attack at least once, however short the run
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


async def run_with_abuse(
    base_url: str, api_keys: list[str], abuser_keys: tuple[str, str], jobs: list[Job], args: argparse.Namespace, model_name: str
) -> tuple[list[Outcome], float, AbuseTally]:
    """The well-behaved clients here, as in the run alone; the abusers in a process of their
    own at a lower CPU priority, as they would be on another machine: in this process their
    clients' own work (encoding 30,000 tools, 160 flooding lanes) took the interpreter lock
    from the server and the well-behaved clients, and the run measured the load generator."""
    import multiprocessing

    slow_body = {"model": model_name, "prompt": "Never read: " + TEXT[:200], "max_tokens": args.slow_reader_tokens,
                 "temperature": 0, "stream": True, "logprobs": 5}
    slow_tally = AbuseTally()
    sockets = open_slow_readers(base_url, abuser_keys[0], slow_body, args.slow_readers, slow_tally)
    spawn = multiprocessing.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    # The victim of the grammar pairs: a well-behaved key asking for a small schema meanwhile.
    options = {**vars(args), "victim_key": api_keys[-1]}
    abusers = spawn.Process(target=abuse_in_own_process, args=(base_url, abuser_keys, model_name, options, stop, results), daemon=True)
    abusers.start()
    try:
        outcomes, wall_s = await run_clients(base_url, api_keys, jobs, args)
        stop.set()
        # The whole store flood lands before the well-behaved key looks for its response.
        fields = await asyncio.to_thread(results.get, True, args.request_timeout_s + args.time_limit_s)
        tally = AbuseTally(**{**fields, "doors": DoorTally(**fields["doors"])})
    finally:
        for sock in sockets:
            sock.close()
        abusers.join(30)
        if abusers.is_alive():
            abusers.kill()
    tally.slow_readers = slow_tally.slow_readers
    return outcomes, wall_s, tally


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


def key_rows(alone: list[Outcome], abused: list[Outcome], num_keys: int) -> list[KeyRow]:
    rows = []
    for k in range(num_keys):
        mine = [o for o in alone if o.key_index == k]
        theirs = [o for o in abused if o.key_index == k]

        def p99(outcomes: list[Outcome]) -> float | None:
            return _round(percentile([o.latency_s for o in outcomes if o.status == "completed" and o.latency_s is not None], 99))

        rows.append(KeyRow(
            k, sum(o.status == "completed" for o in mine), sum(o.status == "failed" for o in mine), p99(mine),
            sum(o.status == "completed" for o in theirs), sum(o.status == "failed" for o in theirs), p99(theirs),
        ))  # fmt: skip
    return rows


# -- checks and report -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def wait_idle(async_engine: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and async_engine.stats().num_unfinished:
        time.sleep(0.05)


def final_check(engine: Any) -> dict[str, Any]:
    """Runs on the engine thread: nothing left running, every page free or cached, unlocked."""
    result = {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "unfinished": engine.num_unfinished,
        "error": None,
    }
    try:
        engine.check_invariants()
        engine.pool.check_invariants()
        locked = engine.tree.locked_pages
        pinned = engine.pins.pages
        if not pinned and locked:
            raise AssertionError(f"{locked} pages still locked with no request running")
        if not pinned and engine.pool.num_free + engine.tree.cached_pages != engine.pool.num_pages:
            raise AssertionError(
                f"free {engine.pool.num_free} + cached {engine.tree.cached_pages} != total {engine.pool.num_pages}"
            )
    except AssertionError as error:
        result["error"] = str(error) or repr(error)
    return result


def server_aborts(base_url: str, api_key: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10, headers={"Authorization": f"Bearer {api_key}"}).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "radixkv_request_finished_total" and sample.labels.get("finish_reason") == "abort"
    )


def make_report(args, model_name, outcomes, wall_s, stats, check, aborts_on_server) -> Report:
    completed = [o for o in outcomes if o.status == "completed"]
    failed = [o for o in outcomes if o.status == "failed"]
    prompt_tokens = sum(o.prompt_tokens for o in completed)
    return Report(
        model=model_name,
        clients=args.clients,
        requests=args.requests,
        started=len(outcomes),
        completed=len(completed),
        failed=len(failed),
        aborted=sum(1 for o in outcomes if o.status == "aborted"),
        server_aborts=aborts_on_server,
        wall_s=round(wall_s, 2),
        requests_per_s=round(len(completed) / wall_s, 2) if wall_s else 0.0,
        output_tokens_per_s=round(sum(o.completion_tokens for o in completed) / wall_s, 1) if wall_s else 0.0,
        latency_p50_s=_round(percentile([o.latency_s for o in completed if o.latency_s is not None], 50)),
        latency_p99_s=_round(percentile([o.latency_s for o in completed if o.latency_s is not None], 99)),
        ttft_p50_s=_round(percentile([o.ttft_s for o in completed if o.ttft_s is not None], 50)),
        ttft_p99_s=_round(percentile([o.ttft_s for o in completed if o.ttft_s is not None], 99)),
        cached_token_fraction=round(sum(o.cached_tokens for o in completed) / max(1, prompt_tokens), 3),
        preemptions=stats.num_preemptions,
        evicted_pages=stats.cache.evicted_pages,
        final_running=check["running"],
        final_waiting=check["waiting"],
        final_unfinished=check["unfinished"],
        invariant_ok=check["error"] is None,
        invariant_error=check["error"],
        failures=[f"#{o.index}: {o.error}" for o in failed[:20]],
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def format_table(report: Report) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    rows = [
        ("model", report.model),
        ("clients / requests", f"{report.clients} / {report.requests}"),
        ("completed", report.completed),
        ("failed", report.failed),
        ("aborted (client left)", report.aborted),
        ("aborts seen by server", int(report.server_aborts)),
        ("wall time (s)", f"{report.wall_s:.1f}"),
        ("requests/s", report.requests_per_s),
        ("output tokens/s", report.output_tokens_per_s),
        ("latency p50 / p99 (s)", f"{s(report.latency_p50_s)} / {s(report.latency_p99_s)}"),
        ("TTFT p50 / p99 (s)", f"{s(report.ttft_p50_s)} / {s(report.ttft_p99_s)}"),
        ("cached prompt tokens", f"{report.cached_token_fraction:.1%}"),
        ("preemptions / evicted pages", f"{report.preemptions} / {report.evicted_pages}"),
        ("left running / waiting", f"{report.final_running} / {report.final_waiting}"),
        ("page invariant", "ok" if report.invariant_ok else f"BROKEN: {report.invariant_error}"),
        ("verdict", "PASS" if report.ok else "FAIL"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value", f"|{'-' * (width + 2)}|------"]
    lines += [f"| {name.ljust(width)} | {value}" for name, value in rows]
    if report.abuse is not None:
        lines += ["", format_abuse(report)]
    return "\n".join(lines)


def format_abuse(report: Report) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [
        "| well-behaved key | completed / failed alone | p99 alone (s) | completed / failed with abuse | p99 with abuse (s) | ratio",
        "|------------------|--------------------------|---------------|-------------------------------|--------------------|------",
    ]
    for row in report.keys:
        ratio = "-" if row.p99_ratio is None else f"{row.p99_ratio:.2f}"
        lines.append(
            f"| key {row.key_index:<12} | {row.completed} / {row.failed:<20} | {s(row.p99_alone_s):<13} | "
            f"{row.completed_with_abuse} / {row.failed_with_abuse:<25} | {s(row.p99_with_abuse_s):<18} | {ratio}"
        )
    tally = report.abuse
    assert tally is not None
    lines += [
        "",
        f"flooding key: {tally.flood_sent} sent, {tally.flood_refused_429} refused with 429, {tally.flood_other} other errors",
        f"oversized bodies: {tally.oversized_sent} sent, {tally.oversized_refused_413} refused with 413 (or 429), "
        f"{tally.oversized_cut_off} cut off unread",
        f"slow readers: {tally.slow_readers} opened and never read (aborts seen by server: {int(report.server_aborts)})",
        f"requests with too many tools: {tally.many_tools_sent} sent, {tally.many_tools_refused} refused with 4xx",
        f"messages with too many cache_control breakpoints: {tally.breakpoints_sent} sent, {tally.breakpoints_refused} refused with 4xx",
        f"JSON schemas with no way on: {tally.dead_schema_sent} sent, {tally.dead_schema_refused} refused with 400",
        f"retention under a new cache_salt each time: {tally.salt_rotations_sent} sent, {tally.salt_rotations_other} unexpected answers; "
        f"retained pages at the end {tally.retained_pages_end} (cap {tally.retained_pages_cap})",
        f"stored Responses flood: {tally.store_flood_sent} sent, {tally.store_flood_other} unexpected answers",
        f"the well-behaved key's retained prefix kept: {tally.well_retained_kept} (cached tokens before / after: "
        f"{tally.well_retained_tokens[0]} / {tally.well_retained_tokens[1]}); its stored response kept: {tally.well_stored_kept}",
        f"echoed replies around forged splice markers: {tally.doors.echo_splice_sent} sent, "
        f"slowest answer {tally.doors.echo_splice_slowest_s:.2f} s",
        f"grammar pairs: {tally.doors.grammar_pairs_sent}; lookups past the context: {tally.doors.lookups_past_context_sent}; "
        f"logit_bias keys of 5,000 digits: {tally.doors.logit_bias_digits_sent}; unexpected answers: {tally.doors.unexpected}",
        f"the victim key's 3-property schema beside the grammar pairs: {tally.doors.victim_schema_served} of "
        f"{tally.doors.victim_schema_sent} served",
        f"abuse verdict: {'PASS' if report.abuse_ok else 'FAIL'} (p99 ratio at most {report.max_p99_ratio:g})",
    ]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine
    from radixkv.cli import served_model_name
    from radixkv.server.app import create_app
    from radixkv.server.limits import ServerLimits

    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, num_pages=args.num_pages, page_size=args.page_size,
        max_num_seqs=args.max_num_seqs, check_invariants=args.check_invariants,
        max_queue_len=max(4096, args.requests), max_retained_pages_per_owner=args.retain_cap,
    )
    print(f"loading {args.model or 'the default model'} ...", flush=True)

    def make_engine() -> Engine:
        engine = Engine(config)
        if not getattr(engine.tokenizer, "chat_template", None):
            engine.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        return engine

    async_engine = AsyncEngine.build(make_engine)  # built where it steps (AsyncEngine.build says why)
    engine = async_engine.engine
    model_name = served_model_name(args.model)
    api_keys = [f"sk-load-{k}-" + secrets.token_hex(8) for k in range(args.well_keys)]
    abuser_keys = ("sk-abuse-flood-" + secrets.token_hex(8), "sk-abuse-probe-" + secrets.token_hex(8))
    jobs = build_jobs(args, engine.tokenizer, model_name)
    # A well-behaved key's cap must not bind on well-behaved traffic: clients take jobs from one
    # queue, so every client may be on one key at once, and a client that left may already be
    # on its next request while the server is still aborting the last. The flooding key gets
    # the same share, and floods past it.
    share = args.clients * (2 if args.disconnect_fraction > 0 else 1)
    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes, stream_send_timeout_s=args.stream_send_timeout_s, max_requests_per_key=share
    )
    alone: list[Outcome] = []
    tally = None
    try:
        app = create_app(async_engine, api_keys=[*api_keys, *abuser_keys], model_name=model_name, limits=limits)
        with ServerThread(app, HOST) as server:
            print(
                f"serving on {server.base_url}: {engine.pool.num_pages} KV pages of {engine.pool.page_size} tokens; "
                f"{args.clients} clients, {args.requests} requests{' (twice: alone, then with abuse)' if args.abuse else ''}",
                flush=True,
            )
            if args.abuse:
                alone, _ = asyncio.run(run_clients(server.base_url, api_keys, salted(jobs, "alone"), args))
                wait_idle(async_engine, timeout_s=60)
                kept = keep_before_abuse(server.base_url, api_keys[0], model_name)
                well_retained = async_engine.call(lambda e: e.stats().cache.retained_pages).result(60)
                # Only the retained pages are promised to stay (at most the cap); the rest may go.
                kept.retained_tokens = min(kept.retained_tokens, well_retained * args.page_size)
                outcomes, wall_s, tally = asyncio.run(
                    run_with_abuse(server.base_url, api_keys, abuser_keys, salted(jobs, "abused"), args, model_name)
                )
                check_after_abuse(server.base_url, api_keys[0], model_name, kept, tally)
                tally.retained_pages_end = async_engine.call(lambda e: e.stats().cache.retained_pages).result(60)
                tally.retained_pages_cap = args.retain_cap + well_retained
            else:
                outcomes, wall_s = asyncio.run(run_clients(server.base_url, api_keys, jobs, args))
            wait_idle(async_engine, timeout_s=60)
            check = async_engine.call(final_check).result(60)
            stats = async_engine.call(lambda e: e.stats()).result(60)
            aborts = server_aborts(server.base_url, api_keys[0])
    finally:
        async_engine.shutdown()
    from radixkv.scenarios.machine import machine_limits

    limits_measured = machine_limits(engine.dtype)  # after the run: nothing else is running
    print(
        f"{limits_measured['cpu']}, {limits_measured['torch_threads']} threads, read {limits_measured['read_bandwidth_gb_s']:.1f} GB/s, "
        f"{limits_measured['matmul_dtype']} matmul {limits_measured['matmul_gflops']:.0f} GFLOP/s"
    )
    report = make_report(args, model_name, outcomes, wall_s, stats, check, aborts)
    if tally is not None:
        report.abuse, report.keys = tally, key_rows(alone, outcomes, args.well_keys)
        report.max_p99_ratio = args.max_p99_ratio
    print(format_table(report))
    for failure in report.failures:
        print("  failed", failure)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {**asdict(report), "ok": report.ok, "abuse_ok": report.abuse_ok, "args": vars(args), "machine_limits": limits_measured}
    payload["keys"] = [{**asdict(row), "p99_ratio": row.p99_ratio} for row in report.keys]
    (out / "load_test.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'load_test.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
