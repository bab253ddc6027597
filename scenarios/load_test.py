"""Bounded load test of the OpenAI-compatible server on 127.0.0.1.

Starts its own server in-process on a free loopback port, then runs `--clients` concurrent
streaming clients through `--requests` requests: groups sharing a long system prompt and
prompts that share nothing, some clients disconnecting mid-stream. Reports completed, failed
and aborted requests, p50/p99 latency and time to first token, as a table and as JSON, and
ends by checking that no request is left running and that the page accounting holds.

    python -m radixkv.scenarios.load_test [--model DIR] [--clients 64] [--requests 200] [--max-tokens 16]

Every loop is bounded: by the request count, by --time-limit-s for starting requests, and by
--request-timeout-s for each request. Exit status 0 only when nothing failed and every check
passed.
"""

from __future__ import annotations

import argparse
import asyncio
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

from radixkv.scenarios.harness import TEXT
from radixkv.server.thread import ServerThread

HOST = "127.0.0.1"  # loopback only, by design: this is a test, not a benchmark of a network


@dataclass(slots=True)
class Job:
    index: int
    path: str
    body: dict[str, Any]
    shared: bool
    disconnect_after_chunks: int | None  # None: read to the end


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

    @property
    def ok(self) -> bool:
        return (
            self.failed == 0
            and self.completed + self.aborted == self.requests
            and self.invariant_ok
            and self.final_running == self.final_waiting == self.final_unfinished == 0
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
    parser.add_argument("--out", default="out/load_test")
    args = parser.parse_args(argv)
    for name in ("clients", "requests", "max_tokens", "groups", "system_len", "question_len"):
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
        jobs.append(Job(i, path, body, shared, rng.randint(1, 3) if leave else None))
    return jobs


async def run_one(client: httpx.AsyncClient, job: Job, headers: dict[str, str]) -> Outcome:
    outcome = Outcome(job.index, job.shared, "failed")
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
    base_url: str, api_key: str, jobs: list[Job], args: argparse.Namespace
) -> tuple[list[Outcome], float]:
    queue = list(reversed(jobs))
    outcomes: list[Outcome] = []
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    start = time.perf_counter()
    deadline = start + args.time_limit_s

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue and time.perf_counter() < deadline:
            job = queue.pop()
            try:
                outcome = await asyncio.wait_for(run_one(client, job, headers), args.request_timeout_s)
            except TimeoutError:
                outcome = Outcome(job.index, job.shared, "failed", error=f"no answer in {args.request_timeout_s} s")
            outcomes.append(outcome)
            done = len(outcomes)
            if done % max(1, len(jobs) // 10) == 0:
                print(f"  {done}/{len(jobs)} requests done ({time.perf_counter() - start:.0f} s)", flush=True)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
    return outcomes, time.perf_counter() - start


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
        pinned = len(getattr(engine, "_pins", ()))
        if not pinned and locked:
            raise AssertionError(f"{locked} pages still locked with no request running")
        if not pinned and engine.pool.num_free + engine.tree.cached_pages != engine.pool.num_pages:
            raise AssertionError(
                f"free {engine.pool.num_free} + cached {engine.tree.cached_pages} != total {engine.pool.num_pages}"
            )
    except AssertionError as error:
        result["error"] = str(error) or repr(error)
    return result


def server_aborts(base_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
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
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine
    from radixkv.cli import served_model_name
    from radixkv.server.app import create_app

    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, num_pages=args.num_pages, page_size=args.page_size,
        max_num_seqs=args.max_num_seqs, check_invariants=args.check_invariants,
        max_queue_len=max(4096, args.requests),
    )
    print(f"loading {args.model or 'the default model'} ...", flush=True)
    engine = Engine(config)
    model_name = served_model_name(args.model)
    api_key = "sk-load-" + secrets.token_hex(8)
    jobs = build_jobs(args, engine.tokenizer, model_name)
    async_engine = AsyncEngine(engine)
    try:
        app = create_app(async_engine, api_keys=[api_key], model_name=model_name)
        with ServerThread(app, HOST) as server:
            print(
                f"serving on {server.base_url}: {engine.pool.num_pages} KV pages of {engine.pool.page_size} tokens; "
                f"{args.clients} clients, {args.requests} requests",
                flush=True,
            )
            outcomes, wall_s = asyncio.run(run_clients(server.base_url, api_key, jobs, args))
            wait_idle(async_engine, timeout_s=60)
            check = async_engine.call(final_check).result(60)
            stats = async_engine.call(lambda e: e.stats()).result(60)
            aborts = server_aborts(server.base_url)
    finally:
        async_engine.shutdown()
    report = make_report(args, model_name, outcomes, wall_s, stats, check, aborts)
    print(format_table(report))
    for failure in report.failures:
        print("  failed", failure)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {**asdict(report), "ok": report.ok, "args": vars(args)}
    (out / "load_test.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'load_test.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
