"""`radixkv cluster`: its options, and the run that starts a `LocalCluster` (workers.py), prints
where to go, and stops it in order on Ctrl-C or SIGTERM (the router first, then each worker drains).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from radixkv.cluster.workers import POLICIES, ROUTER_INSTALL, LocalCluster, router_installed


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "cluster", help="start N workers behind sglang-router on this machine (to try routing out)",
        description="Start N `radixkv serve` workers and sglang-router (the `router` extra) in front of them, on "
        "this machine. Ctrl-C or SIGTERM stops the router, then drains the workers.",
        epilog="Options after -- go to every worker's `radixkv serve`.",
    )
    parser.add_argument("--workers", type=int, default=2, help="how many `radixkv serve` workers (default 2)")
    parser.add_argument("--model", default=None, help="HF folder or .gguf file; default SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the router's port; workers take the next ones (default 8000)")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's policy (default cache_aware)")
    parser.add_argument("--threads-per-worker", type=int, default=None, help="CPU threads each worker computes with")
    parser.add_argument("--log-dir", default=None, help="where the processes' logs go (default: a new temporary folder)")
    parser.add_argument(
        "--no-sticky-sessions", dest="sticky_sessions", action="store_false",
        help="send every request through the router (default: a request naming a session, X-Radixkv-Session or "
        "prompt_cache_key, goes to the worker that served that session last)",
    )
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `radixkv serve` options for every worker")


def run(args: argparse.Namespace) -> int:
    """`radixkv cluster`: start everything, print the URLs, wait for Ctrl-C or SIGTERM, stop."""
    if not router_installed():
        print(f"error: the router is not installed: {ROUTER_INSTALL}", file=sys.stderr)
        return 2
    worker_args = [a for a in args.serve_args if a != "--"]
    if args.threads_per_worker is not None:
        worker_args += ["--threads", str(args.threads_per_worker)]
    try:
        cluster = LocalCluster(
            args.workers, model=args.model, host=args.host, port=args.port, policy=args.policy,
            worker_args=worker_args, log_dir=Path(args.log_dir) if args.log_dir else None, sticky_sessions=args.sticky_sessions,
        )
    except (ValueError, OSError) as error:  # a bad option, an unreadable key file
        print(f"error: {error}", file=sys.stderr)
        return 2
    stop = _StopOnSignal()
    try:
        with cluster:
            if cluster.front is not None:
                print(f"front door (sticky sessions): {cluster.front_url}/v1  (OpenAI-compatible)")
            print(f"router ({args.policy}): {cluster.router_url}/v1  (OpenAI-compatible)")
            for url in cluster.worker_urls:
                print(f"worker: {url}")
            print(f"logs: {cluster.log_dir}; Ctrl-C stops the router, then drains the workers", flush=True)
            while not stop.requested:
                for member in [*cluster.workers, cluster.router]:
                    if member is not None and member.process.poll() is not None:
                        print(f"error: {member.name} exited ({member.process.returncode}); see {member.log_path}", file=sys.stderr)
                        return 1
                time.sleep(0.5)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        stop.restore()
    return 0


class _StopOnSignal:
    """SIGINT and SIGTERM set `requested` instead of raising, so the cluster stops in order."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, sig: int, frame: object) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
