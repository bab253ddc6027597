"""Two real `radixkv serve` workers behind a real sglang-router (radixkv.cluster.workers.LocalCluster),
policy cache_aware: requests that share a system prompt land on one worker, whose cached tokens
grow; a worker drained with SIGTERM leaves the rotation and no request is lost."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixkv.cluster.workers import LocalCluster, router_installed
from tests.helpers.engine import wait_until

pytestmark = pytest.mark.skipif(
    not router_installed(), reason="sglang-router is not installed (pip install 'radixkv[router]')"
)

PAGE = 16  # `radixkv serve`'s default page size: a prompt's cached part is whole pages
SYSTEM_A = "You are a helpful assistant. Answer briefly and precisely. " * 3
SYSTEM_B = "def add(a, b):\n    return a + b\n" * 5


def completions_served(worker_url: str) -> float:
    """Completions a worker has answered (its own /metrics)."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "radixkv_requests_total" and sample.labels.get("endpoint") == "/v1/completions"
    )


def requests_on(worker_url: str) -> int:
    """Requests a worker holds now, running or waiting (its /get_load)."""
    return httpx.get(f"{worker_url}/get_load", timeout=10).json()[0]["num_reqs"]


def flood_report(cluster: LocalCluster, futures: list[concurrent.futures.Future]) -> str:
    """What a failed wait saw: the router's healthy workers, each worker's load and served
    completions, and how the flood's requests ended so far (status, or still open)."""

    def ended(future: concurrent.futures.Future) -> object:
        if not future.done():
            return "open"
        return repr(future.exception()) if future.exception() is not None else future.result().status_code

    loads = {u: (requests_on(u), completions_served(u)) for u in cluster.worker_urls}
    routed = sorted(cluster.healthy_workers())
    return f"router routes to {routed}; (requests, completions) by worker {loads}; flood {[ended(f) for f in futures]}"


def complete(router_url: str, model: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{router_url}/v1/completions", json=body, timeout=120)


def test_cache_aware_routing_and_a_drained_worker(tiny_llama: Path, tmp_path: Path):
    worker_args = ["--num-pages", "256", "--dtype", "float32", "--threads", "1", "--drain-timeout-s", "60"]
    with LocalCluster(2, model=str(tiny_llama), worker_args=worker_args, log_dir=tmp_path) as cluster:
        urls = cluster.worker_urls
        # 1. Sequential requests, two system prompts: each prompt's requests go to one worker
        # (the router's approximate tree matches their text), whose cache serves the prefix.
        served_by: dict[str, set[str]] = {"A": set(), "B": set()}
        for i in range(4):
            for name, system in (("A", SYSTEM_A), ("B", SYSTEM_B)):
                before = [completions_served(u) for u in urls]
                response = complete(cluster.router_url, tiny_llama.name, f"{system}Question {i}?", 4)
                assert response.status_code == 200, response.text
                after = [completions_served(u) for u in urls]
                (worker,) = [u for u, b, a in zip(urls, before, after) if a == b + 1]
                served_by[name].add(worker)
                usage = response.json()["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if i == 0:
                    assert cached < usage["prompt_tokens"] - 2 * PAGE  # cold: at most a shared first block
                else:
                    assert cached >= usage["prompt_tokens"] - PAGE  # every full block of the prefix
        assert len(served_by["A"]) == len(served_by["B"]) == 1, served_by
        (holder,) = served_by["A"]
        other = next(u for u in urls if u != holder)

        # 2. A flood sharing prompt A, all on its worker; SIGTERM that worker mid-flood. It
        # refuses new work and finishes what it runs; the router retries the refusals and takes
        # the worker out; every request completes.
        def one(i: int) -> httpx.Response:
            return complete(cluster.router_url, tiny_llama.name, f"{SYSTEM_A}Flood {i}?", 32)

        served_before = completions_served(holder)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(16)]

            def reached_holder() -> bool:
                # Polls can miss the few ms a tiny model's request is in flight; the count of
                # served completions cannot (a full-suite run once missed all of them for 20 s).
                return requests_on(holder) > 0 or completions_served(holder) > served_before

            assert wait_until(reached_holder), flood_report(cluster, futures)
            status = cluster.drain_worker(urls.index(holder))
            responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
        assert status == 0
        log = cluster.workers[urls.index(holder)].log_tail(20000)
        assert "+ 0 in use ==" in log and "0 request(s) left" in log, log
        assert wait_until(lambda: cluster.healthy_workers() == {other}), cluster.healthy_workers()
        assert complete(cluster.router_url, tiny_llama.name, f"{SYSTEM_A}After?", 4).status_code == 200



def test_keyed_workers_open_their_operator_endpoints_to_the_router(monkeypatch, tmp_path):
    """The router polls /get_load and /server_info without a key: keyed workers open those
    (AccessGuard would refuse them), keyless ones need nothing, an explicit choice stands."""
    monkeypatch.delenv("RADIXKV_API_KEYS", raising=False)
    monkeypatch.delenv("RADIXKV_ADMIN_KEYS", raising=False)
    assert "--public-operator-endpoints" in LocalCluster(1, worker_args=["--api-key-file", "k"], log_dir=tmp_path).worker_args
    assert "--public-operator-endpoints" in LocalCluster(1, worker_args=["--admin-key=x"], log_dir=tmp_path).worker_args
    assert LocalCluster(1, worker_args=["--threads", "1"], log_dir=tmp_path).worker_args == ["--threads", "1"]
    assert LocalCluster(1, worker_args=["--api-key", "k", "--public-metrics"], log_dir=tmp_path).worker_args.count("--public-metrics") == 1
    monkeypatch.setenv("RADIXKV_API_KEYS", "k")
    assert LocalCluster(1, log_dir=tmp_path).worker_args == ["--public-operator-endpoints"]


def test_sticky_sessions_reach_the_worker_that_holds_them(tiny_llama: Path, tmp_path: Path):
    worker_args = ["--num-pages", "256", "--dtype", "float32", "--threads", "1"]
    with LocalCluster(2, model=str(tiny_llama), worker_args=worker_args, log_dir=tmp_path, sticky_sessions=True) as cluster:
        assert cluster.front_url != cluster.router_url
        conversation = SYSTEM_A
        for turn in range(3):
            conversation += f" Turn {turn}?"
            body = {"model": tiny_llama.name, "prompt": conversation, "max_tokens": 4, "temperature": 0, "prompt_cache_key": "agent-1"}
            response = httpx.post(f"{cluster.front_url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            conversation += response.json()["choices"][0]["text"]
        turns = {}
        for url in cluster.worker_urls:
            listed = httpx.get(f"{url}/v1/cache/sessions", timeout=10).json()["data"]
            turns[url] = [s["turns"] for s in listed if s["key"] == "agent-1"]
        assert sorted(turns.values()) == [[], [3]], turns  # every turn on one worker, which retains it
        response = httpx.post(f"{cluster.front_url}/v1/completions", json={**body, "prompt_cache_key": None}, timeout=120)
        assert response.status_code == 200, response.text  # no session: through the router
