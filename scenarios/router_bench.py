"""Router bench: two `radixkv serve` workers (one CPU thread each) behind sglang-router, the same
agent traffic (8 long system prompts, short distinct questions, a few concurrent clients) under
the router's `cache_aware` policy and under `round_robin`, each on fresh workers.

    radixkv bench router_bench [--model DIR] [--policies cache_aware,round_robin] [--system-prompts 8]
                               [--system-len 512] [--requests 64] [--concurrency 4] [--out out/router_bench]

Each worker's KV pool holds about (system prompts / workers + 2) of the system prompts, so a
policy that sends every prompt everywhere (round robin) makes each worker cycle all of them
through a pool too small for them, while one that keeps a prompt on one worker (cache aware)
fits. Reported per policy: the prefix-cache hit rate (cached / prompt tokens, from each reply's
usage), throughput (requests and generated tokens per second), p50 / p90 time to first token and
p90 latency (client side, through the router), and how many requests each worker served; in a
table, JSON and a PNG, beside the CPU and its measured limits (scenarios/machine.py). Needs the
`router` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixkv.cluster.workers import ROUTER_INSTALL, LocalCluster, router_installed
from radixkv.scenarios.harness import load_tokenizer, text_tokens
from radixkv.scenarios.plots import pyplot, save

PAGE_SIZE = 16  # `radixkv serve`'s default


@dataclass(frozen=True, slots=True)
class Request:
    system: int  # which system prompt
    messages: list[dict]


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class PolicyResult:
    policy: str
    requests: int
    failed: int
    wall_s: float
    hit_rate: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    latency_p90_s: float | None
    served_per_worker: list[int] = field(default_factory=list)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=512, help="tokens of each system prompt")
    parser.add_argument("--question-len", type=int, default=24, help="tokens of each question")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages per worker (default: see above)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/router_bench")
    return parser.parse_args(argv)


def build_requests(args: argparse.Namespace) -> list[Request]:
    """Distinct system prompts (real text from different offsets, so no two start alike) in a
    seeded random order, each with a question of its own."""
    tokenizer = load_tokenizer(args.model)
    systems = [
        f"You are agent {k}. " + tokenizer.decode(text_tokens(tokenizer, args.system_len, offset=97 * k))
        for k in range(args.system_prompts)
    ]
    rng = random.Random(args.seed)
    order = [i % args.system_prompts for i in range(args.requests)]
    rng.shuffle(order)
    requests = []
    for i, k in enumerate(order):
        question = tokenizer.decode(text_tokens(tokenizer, args.question_len, offset=1000 + 37 * i))
        messages = [{"role": "system", "content": systems[k]}, {"role": "user", "content": f"Question {i}: {question}"}]
        requests.append(Request(k, messages))
    return requests


def default_num_pages(args: argparse.Namespace) -> int:
    """Room for this worker's share of the system prompts plus two more (and the requests
    running), not for all of them."""
    per_prompt = math.ceil((args.system_len + args.question_len + args.max_tokens + 64) / PAGE_SIZE)
    share = math.ceil(args.system_prompts / args.workers)
    return per_prompt * (share + 2)


async def send(client: httpx.AsyncClient, url: str, model: str, request: Request, max_tokens: int) -> Outcome:
    body = {
        "model": model, "messages": request.messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft_s = None
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome(False, error=f"{response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(False, error=str(event["error"]))
                choices = event.get("choices") or []
                if ttft_s is None and any(c.get("delta", {}).get("content") for c in choices):
                    ttft_s = time.perf_counter() - start  # the role chunk comes before any work
                usage = event.get("usage") or usage
    except httpx.HTTPError as error:
        return Outcome(False, error=repr(error))
    if usage is None:
        return Outcome(False, error="no usage in the stream")
    return Outcome(
        True, ttft_s, time.perf_counter() - start, usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), usage["completion_tokens"],
    )


async def run_clients(url: str, model: str, requests: list[Request], concurrency: int, max_tokens: int) -> tuple[list[Outcome], float]:
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    outcomes: list[Outcome] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            outcomes.append(await send(client, url, model, queue.get_nowait(), max_tokens))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return outcomes, time.perf_counter() - start


def completions_served(worker_url: str) -> int:
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    return int(sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "radixkv_requests_total" and s.labels.get("endpoint") == "/v1/chat/completions"
    ))


def run_policy(args: argparse.Namespace, policy: str, requests: list[Request], model: str, num_pages: int) -> PolicyResult:
    worker_args = ["--num-pages", str(num_pages), "--threads", str(args.threads_per_worker)]
    with LocalCluster(args.workers, model=args.model, policy=policy, worker_args=worker_args) as cluster:
        for url in cluster.worker_urls:  # first-use costs (kernel loading) out of the timing
            httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            }).raise_for_status()
        warm = [completions_served(u) for u in cluster.worker_urls]
        outcomes, wall_s = asyncio.run(run_clients(cluster.router_url, model, requests, args.concurrency, args.max_tokens))
        served = [completions_served(u) - w for u, w in zip(cluster.worker_urls, warm)]
    done = [o for o in outcomes if o.ok]
    for o in outcomes:
        if not o.ok:
            print(f"  {policy}: failed: {o.error}", file=sys.stderr)
    prompt_tokens = sum(o.prompt_tokens for o in done)
    return PolicyResult(
        policy, len(outcomes), len(outcomes) - len(done), wall_s,
        sum(o.cached_tokens for o in done) / prompt_tokens if prompt_tokens else 0.0,
        len(done) / wall_s, sum(o.completion_tokens for o in done) / wall_s,
        percentile([o.ttft_s for o in done if o.ttft_s is not None], 0.5),
        percentile([o.ttft_s for o in done if o.ttft_s is not None], 0.9),
        percentile([o.latency_s for o in done if o.latency_s is not None], 0.9),
        served,
    )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def format_table(results: list[PolicyResult]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    lines = [
        f"{'policy':<12} {'ok':>6} {'hit rate':>9} {'req/s':>7} {'tok/s':>7} {'ttft p50 ms':>12} {'ttft p90 ms':>12} "
        f"{'p90 ms':>8}  served per worker"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<12} {r.requests - r.failed:>3}/{r.requests:<2} {r.hit_rate:>9.1%} {r.requests_per_s:>7.2f} "
            f"{r.output_tokens_per_s:>7.1f} {ms(r.ttft_p50_s):>12} {ms(r.ttft_p90_s):>12} {ms(r.latency_p90_s):>8}  {r.served_per_worker}"
        )
    return "\n".join(lines)


def plot(results: list[PolicyResult], path: Path, title: str) -> None:
    plt = pyplot()

    names = [r.policy for r in results]
    panels = [
        ("prefix-cache hit rate", [r.hit_rate for r in results], "{:.0%}"),
        ("throughput (requests/s)", [r.requests_per_s for r in results], "{:.2f}"),
        ("p90 time to first token (s)", [r.ttft_p90_s or 0.0 for r in results], "{:.2f}"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.4))
    for ax, (panel, values, fmt) in zip(axes, panels):
        bars = ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(names)])
        ax.bar_label(bars, labels=[fmt.format(v) for v in values])
        ax.set_title(panel, fontsize=10)
        ax.margins(y=0.2)
    fig.suptitle(title, fontsize=10)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not router_installed():
        print(f"error: the router is not installed: {ROUTER_INSTALL}", file=sys.stderr)
        return 2
    from radixkv.cli import served_model_name
    from radixkv.model import resolve_device, resolve_dtype
    from radixkv.scenarios.machine import machine_limits

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    requests = build_requests(args)
    model = served_model_name(args.model)
    num_pages = args.num_pages or default_num_pages(args)
    print(
        f"{args.workers} workers x {args.threads_per_worker} thread(s), {num_pages} KV pages each; {args.requests} requests over "
        f"{args.system_prompts} system prompts of {args.system_len} tokens, {args.concurrency} clients", flush=True,
    )
    results = []
    for policy in policies:
        results.append(run_policy(args, policy, requests, model, num_pages))
        print(f"  {policy}: done in {results[-1].wall_s:.1f} s", flush=True)
    limits = machine_limits(resolve_dtype("auto", resolve_device("cpu")))
    table = format_table(results)
    print(table)
    print(f"cpu: {limits['cpu']}; read {limits['read_bandwidth_gb_s']:.1f} GB/s, {limits['matmul_dtype']} matmul "
          f"{limits['matmul_gflops']:.0f} GFLOP/s ({limits['torch_threads']} threads)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "scenario": "router_bench", "model": model, "workers": args.workers, "threads_per_worker": args.threads_per_worker,
        "num_pages_per_worker": num_pages, "page_size": PAGE_SIZE, "system_prompts": args.system_prompts,
        "system_len": args.system_len, "question_len": args.question_len, "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "machine": limits,
        "results": [asdict(r) for r in results],
    }
    (out / "router_bench.json").write_text(json.dumps(report, indent=2))
    title = f"sglang-router over {args.workers} radixkv workers ({args.threads_per_worker} thread(s) each), same traffic per policy"
    plot(results, out / "router_bench.png", title)
    print(f"wrote {out / 'router_bench.json'} and {out / 'router_bench.png'}")
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
