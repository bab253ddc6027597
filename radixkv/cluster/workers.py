"""N `radixkv serve` workers behind one sglang-router on this machine, to try prefix-aware
routing out: `LocalCluster` starts and stops them (`radixkv cluster` in command.py, the tests and
scenarios/router_bench.py share it). With sticky sessions a front door (front_door.py) sends a
session's requests to the worker that served it last, under the workers' keys and limits
(`front_door_guards`). Stopping stops the front door and the router, then drains every worker.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from radixkv.cluster.front_door import ProxyThread, SessionProxy, front_door_guards

ROUTER_PACKAGE = "sglang_router"
ROUTER_INSTALL = "pip install 'radixkv[router]'  (or: pip install sglang-router)"
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# The router checks each worker this often, and takes one out after this many failed checks in
# a row: a draining worker answers /health with 503, so it leaves within about two seconds.
HEALTH_CHECK_INTERVAL_S = 1
HEALTH_FAILURE_THRESHOLD = 2
# Until then the router keeps choosing the draining worker, which refuses with 503 (and, once it
# has exited, cannot be reached): the router retries those, backing off from 250 ms up to 2 s, 8
# tries in all (about 7 s), so a retry outlives the health checks and lands on a live worker.
RETRY_ARGS = ("--retry-max-retries", "8", "--retry-initial-backoff-ms", "250", "--retry-max-backoff-ms", "2000")


def router_installed() -> bool:
    return importlib.util.find_spec(ROUTER_PACKAGE) is not None


@dataclass(slots=True)
class Member:
    """One process of the cluster: a worker or the router."""

    name: str
    url: str
    process: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]

    def log_tail(self, chars: int = 4000) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-chars:]


class LocalCluster:
    """Workers on ports port+1..port+N and the router on `port` (None: free ports), all on
    `host`. worker_args are extra `radixkv serve` options for every worker; router_args extra
    `sglang_router.launch_router` options. Processes write their logs into log_dir."""

    def __init__(
        self,
        num_workers: int,
        *,
        model: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "cache_aware",
        worker_args: list[str] | None = None,
        router_args: list[str] | None = None,
        log_dir: Path | None = None,
        startup_timeout_s: float = 300.0,
        sticky_sessions: bool = False,
        max_sticky_sessions: int = 65536,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"a cluster needs at least one worker, got {num_workers}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.num_workers = num_workers
        self.model = model
        self.host = host
        self.policy = policy
        # The front door asks what the workers ask: read before operator endpoints are opened.
        self.front_guards = front_door_guards(list(worker_args or []), host) if sticky_sessions else None
        self.worker_args = _open_operator_endpoints_if_keyed(list(worker_args or []))
        self.router_args = list(router_args or [])
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="radixkv-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        # With sticky sessions the front door takes `port` and the router the port after the workers'.
        count = num_workers + 1 + int(sticky_sessions)
        ports = [port + i for i in range(count)] if port is not None else _free_ports(host, count)
        self.front_port = ports[0] if sticky_sessions else None
        self.router_port = ports[-1] if sticky_sessions else ports[0]
        self.worker_ports = ports[1 : num_workers + 1]
        self.max_sticky_sessions = max_sticky_sessions
        self.front: ProxyThread | None = None
        # The router also serves its own Prometheus metrics, on a port of its own (29000 unless
        # told): a free one, so two clusters on one machine do not collide.
        self.router_metrics_port = _free_ports(host, 1)[0]
        self.workers: list[Member] = []
        self.router: Member | None = None

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def front_url(self) -> str:
        """Where clients go: the sticky-session front door, or the router without one."""
        return self.front.url if self.front is not None else self.router_url

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.worker_ports]

    def __enter__(self) -> LocalCluster:
        try:
            self.start_workers()
            self.start_router()
            if self.front_port is not None and self.front_guards is not None:  # both with sticky sessions
                tenants, limits = self.front_guards
                proxy = SessionProxy(self.router_url, self.worker_urls, max_sessions=self.max_sticky_sessions, tenants=tenants, limits=limits)
                self.front = ProxyThread(proxy, self.host, self.front_port).start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_workers(self) -> None:
        """Start every worker and wait until each answers /health (they load in parallel)."""
        for i, (port, url) in enumerate(zip(self.worker_ports, self.worker_urls)):
            # The router checks health every second: its requests would fill the workers' logs.
            command = [sys.executable, "-m", "radixkv.cli", "serve", "--host", self.host, "--port", str(port), "--no-access-log"]
            if self.model is not None:
                command += ["--model", self.model]
            self.workers.append(self._spawn(f"worker{i}", url, command + self.worker_args))
        for worker in self.workers:
            self._wait_ready(worker, "/health")

    def start_router(self) -> None:
        """Start the router over the workers and wait until it routes to all of them."""
        if not router_installed():
            raise RuntimeError(f"the router is not installed: {ROUTER_INSTALL}")
        command = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.router_port),
            "--policy", self.policy, "--worker-urls", *self.worker_urls,
            "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
            "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD),
            "--prometheus-host", self.host, "--prometheus-port", str(self.router_metrics_port),
            *RETRY_ARGS, "--log-level", "warn", *self.router_args,
        ]
        self.router = self._spawn("router", self.router_url, command)
        self._wait_ready(self.router, "/health")
        deadline = time.monotonic() + self.startup_timeout_s
        while self.healthy_workers() != set(self.worker_urls):
            self._check_alive(self.router)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not take in every worker:\n{self.router.log_tail()}")
            time.sleep(0.2)

    def healthy_workers(self) -> set[str]:
        """The worker URLs the router routes to now (its /workers listing)."""
        try:
            listing = httpx.get(f"{self.router_url}/workers", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {w["url"] for w in listing.get("workers", []) if w.get("is_healthy")}

    def drain_worker(self, index: int, timeout_s: float = 120.0) -> int:
        """SIGTERM one worker (it drains, radixkv.server.guards.drain) and wait for it to exit; its status."""
        worker = self.workers[index]
        worker.process.send_signal(signal.SIGTERM)
        return worker.process.wait(timeout_s)

    def stop(self, timeout_s: float = 120.0) -> list[int | None]:
        """Stop the router first (no new traffic), then drain every worker still running; the
        workers' exit statuses."""
        if self.front is not None:
            self.front.stop()
            self.front = None
        if self.router is not None:
            _terminate(self.router.process, 10.0)
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)
        statuses = [_terminate(worker.process, timeout_s) for worker in self.workers]
        for member in [*self.workers, *([self.router] if self.router else [])]:
            member.log_file.close()
        return statuses

    def _spawn(self, name: str, url: str, command: list[str]) -> Member:
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed by stop()
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        # A new session: a Ctrl-C at the terminal reaches `radixkv cluster` alone, which then
        # stops the router and drains the workers in order.
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return Member(name, url, process, log_path, log_file)

    def _wait_ready(self, member: Member, path: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            self._check_alive(member)
            try:
                if httpx.get(member.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{member.name} did not come up in {self.startup_timeout_s:g} s:\n{member.log_tail()}")
            time.sleep(0.2)

    @staticmethod
    def _check_alive(member: Member) -> None:
        if member.process.poll() is not None:
            raise RuntimeError(f"{member.name} exited with status {member.process.returncode}:\n{member.log_tail()}")


def _terminate(process: subprocess.Popen, timeout_s: float) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _free_ports(host: str, count: int) -> list[int]:
    """Ports free now (the OS picks them; held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


_KEY_OPTIONS = ("--api-key", "--api-key-file", "--admin-key", "--admin-key-file")
_KEY_ENVS = ("RADIXKV_API_KEYS", "RADIXKV_ADMIN_KEYS")
_OPEN_OPTIONS = ("--public-operator-endpoints", "--public-metrics")


def _open_operator_endpoints_if_keyed(worker_args: list[str]) -> list[str]:
    """Workers with API keys ask for one on /get_load and /server_info too, which the router
    polls without any (its --api-key would also lock the router itself to that one key): so a
    keyed cluster's workers open their operator endpoints (load and limits, no tenant data), on
    the cluster's own host, and keep the key on everything else."""
    keyed = any(arg.split("=", 1)[0] in _KEY_OPTIONS for arg in worker_args) or any(os.environ.get(name) for name in _KEY_ENVS)
    if keyed and not any(arg in _OPEN_OPTIONS for arg in worker_args):
        return [*worker_args, "--public-operator-endpoints"]
    return worker_args
