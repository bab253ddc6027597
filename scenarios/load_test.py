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
import json
import math
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixkv.scenarios.abuse_clients import (
    AbuseTally,
    abuse_in_own_process,
    check_after_abuse,
    keep_before_abuse,
    open_slow_readers,
)
from radixkv.scenarios.abuse_doors import DoorTally
from radixkv.scenarios.load_clients import Job, Outcome, build_jobs, run_clients, salted
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
