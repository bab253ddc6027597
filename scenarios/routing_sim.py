"""Routing simulation: a Mooncake-format trace over N simulated replicas, each a real RadixTree
and PagePool behind the engine's admission path (scenarios/trace_replay.py's model), under the
routing policies replicas are run behind: round robin, least load, prefix affinity (a hash of
the first blocks) and cache aware (sglang-router's idea: the longest cached match, unless that
replica's load is past a bound over the least loaded one).

    radixkv bench routing_sim [--trace PATH] [--replicas 4,16,64] [--total-fraction 0.5]
                              [--tokens-per-s 20000] [--out out/routing_sim]

Each replica holds total-fraction x the trace's distinct blocks / N. Load is a replica's queued
prefill work in tokens: a request adds the tokens its replica does not have cached, and a
replica works its queue off at --tokens-per-s from the trace's timestamps. Reported per
(replicas, policy): the prefix-hit ratio, the prefill tokens the hits saved, and the load
imbalance (max over mean of the replicas' queued tokens, averaged over arrivals).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from radixkv.cache import BlockHasher, PagePool, RadixTree
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SequenceState
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scenarios.plots import pyplot, save, save_results
from radixkv.scenarios.trace_replay import block_tokens, load_trace, resolve_trace, serve_request

POLICIES = ("round_robin", "least_load", "prefix_affinity", "cache_aware")
BLOCK_TOKENS = 512  # the trace's block size
AFFINITY_BLOCKS = 4  # prefix affinity hashes this many leading blocks


@dataclass(slots=True)
class Replica:
    kv: KVManager
    queued_tokens: float = 0.0
    last_s: float = 0.0

    def drain_to(self, now_s: float, tokens_per_s: float) -> None:
        self.queued_tokens = max(0.0, self.queued_tokens - (now_s - self.last_s) * tokens_per_s)
        self.last_s = now_s


@dataclass(frozen=True, slots=True)
class Result:
    replicas: int
    policy: str
    hit_ratio: float
    prefill_tokens_saved: int
    load_imbalance: float  # mean over arrivals of max / mean queued tokens


def make_replica(capacity_blocks: int, page_size: int) -> Replica:
    pool = PagePool(capacity_blocks + 1, page_size)  # + the one-token tail's page
    hasher = BlockHasher(page_size, seed=0)  # one seed: a sequence's hashes serve every replica
    return Replica(KVManager(pool, RadixTree(pool, hasher), hasher, enable_prefix_caching=True))


def choose(policy: str, replicas: list[Replica], seq: SequenceState, hash_ids: list[int], number: int, load_bound: float) -> int:
    if policy == "round_robin":
        return number % len(replicas)
    least = min(range(len(replicas)), key=lambda i: replicas[i].queued_tokens)
    if policy == "least_load":
        return least
    if policy == "prefix_affinity":
        key = ",".join(map(str, hash_ids[:AFFINITY_BLOCKS])).encode()
        return zlib.crc32(key) % len(replicas)
    # cache_aware: the longest cached match among replicas not overloaded against the least.
    limit = replicas[least].queued_tokens + load_bound
    matches = [(r.kv.peek(seq).num_cached_tokens, -r.queued_tokens, i) for i, r in enumerate(replicas) if r.queued_tokens <= limit]
    return max(matches)[2]


def simulate(trace, timestamps: list[float], num_replicas: int, policy: str, total_fraction: float, tokens_per_s: float, load_bound: float, page_size: int) -> Result:
    per_replica = max(round(trace.num_distinct_blocks * total_fraction / num_replicas), max(map(len, trace.requests)))
    replicas = [make_replica(per_replica, page_size) for _ in range(num_replicas)]
    params = SamplingParams(max_tokens=1)
    hits = 0
    imbalance = []
    for number, (hash_ids, now_s) in enumerate(zip(trace.requests, timestamps, strict=True)):
        for replica in replicas:
            replica.drain_to(now_s, tokens_per_s)
        prompt = [token for h in hash_ids for token in block_tokens(h, page_size)] + [0]
        seq = SequenceState(number, f"r{number}", 0, prompt, params, None, 0)
        target = replicas[choose(policy, replicas, seq, hash_ids, number, load_bound)]
        ram_hits, _ = serve_request(target.kv, None, seq)
        hits += ram_hits
        target.queued_tokens += (len(hash_ids) - ram_hits) * BLOCK_TOKENS
        loads = [r.queued_tokens for r in replicas]
        mean = sum(loads) / len(loads)
        if mean > 0:
            imbalance.append(max(loads) / mean)
    return Result(num_replicas, policy, hits / trace.num_blocks, hits * BLOCK_TOKENS, sum(imbalance) / max(len(imbalance), 1))


def load_timestamps(path: Path, count: int) -> list[float]:
    """Arrival times in seconds (the trace's timestamps are milliseconds)."""
    times = []
    with path.open() as lines:
        for line in lines:
            if line.strip():
                times.append(float(json.loads(line).get("timestamp", 0)) / 1e3)
                if len(times) >= count:
                    break
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=None, help="a Mooncake-format JSONL trace (default: the shared synthetic one)")
    parser.add_argument("--replicas", default="4,16,64")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--total-fraction", type=float, default=0.5, help="all replicas' capacity over the distinct blocks")
    parser.add_argument("--tokens-per-s", type=float, default=20000.0, help="each replica's prefill rate")
    parser.add_argument("--load-bound", type=float, default=256 * BLOCK_TOKENS, help="cache_aware: queued tokens over the least loaded")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per simulated page (one page per trace block)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--out", default="out/routing_sim")
    args = parser.parse_args(argv)
    path = resolve_trace(args.trace)
    trace = load_trace(path, args.limit)
    timestamps = load_timestamps(path, len(trace.requests))
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"--policies: unknown {sorted(unknown)}; known: {', '.join(POLICIES)}")
    results = [
        simulate(trace, timestamps, int(n), policy, args.total_fraction, args.tokens_per_s, args.load_bound, args.page_size)
        for n in args.replicas.split(",")
        for policy in policies
    ]
    print(f"\nrouting {len(trace.requests)} requests of {path.name} ({trace.num_distinct_blocks} distinct blocks), "
          f"replicas holding {args.total_fraction:.0%} of them together")  # fmt: skip
    print(f"{'replicas':>8} {'policy':<16}{'hit ratio':>10}{'prefill saved':>15}{'imbalance':>10}")
    for r in results:
        print(f"{r.replicas:>8} {r.policy:<16}{r.hit_ratio:>10.3f}{r.prefill_tokens_saved:>15,}{r.load_imbalance:>10.2f}")
    summary = dict(trace=path.name, args=vars(args), results=[asdict(r) for r in results])
    save_results(args.out, "routing_sim", summary, lambda figure: _plot(results, figure))
    return 0


def _plot(results: list[Result], path: Path) -> None:
    plt = pyplot()

    fig, (hit_ax, load_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    for policy in dict.fromkeys(r.policy for r in results):
        mine = [r for r in results if r.policy == policy]
        hit_ax.plot([r.replicas for r in mine], [r.hit_ratio for r in mine], "o-", label=policy)
        load_ax.plot([r.replicas for r in mine], [r.load_imbalance for r in mine], "o-", label=policy)
    for ax, title in ((hit_ax, "prefix-hit ratio"), (load_ax, "load imbalance (max / mean queued)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title, fontsize=9)
    hit_ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
