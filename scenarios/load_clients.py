"""The load test's well-behaved clients: the jobs (groups sharing a long system prompt, prompts
that share nothing, some clients leaving mid-stream) and the streaming clients that run them,
each request's outcome timed from the client's side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from radixkv.scenarios.harness import TEXT

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
