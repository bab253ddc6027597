"""Trace-driven cache simulator: replays a Mooncake-format trace (timestamp, input_length,
output_length, hash_ids of 512-token blocks) through the real RadixTree, PagePool and the
engine's admission path (KVManager: peek, can_admit, admit, commit, release)
without a model, at a RAM capacity and optionally a disk tier under it, and reports prefix-hit
ratios per tier against the infinite cache and Belady's optimal at the same capacity, plus the
cache's own time per request.

    radixkv bench trace_replay [--trace PATH] [--ram-fraction 0.05,0.1,0.25] [--policy lru,slru,session]
                               [--disk-fraction 0,0.25] [--out out/trace_replay]
                               [--ram-bytes 256M,1G --kv-dtype bf16,int8]

With --ram-bytes, RAM is also sized as a budget in bytes for each page storage dtype
(EngineConfig.kv_dtype) side by side: a trace block stands for --block-tokens tokens of a model
of --kv-shape (layers, KV heads, head dim; default SmolLM2-135M's), priced at
PagePool.bytes_per_page (int8: with its scales), so the same bytes hold more int8 blocks; the
table shows the tokens per GiB and the prefix-hit ratio each dtype gets.

Model of the replay: requests run one at a time in trace order; each trace block is one KV
page (its tokens are a fixed run derived from its hash id, so two blocks are the same exactly
when their whole prefixes are); every hash id counts as a full block and a one-token tail
follows, so every block may hit (the trace's own convention). A capacity of C blocks is a
pool of C pages plus the tail's page: the running request's blocks count against it, as in
the Belady model. A block evicted from RAM is written to the disk tier (write-back, an index
in blocks); a match that runs out in RAM continues there and the hit blocks come back into RAM.

Sessions: the `session` rows replay the tree's `session` eviction order with sessions inferred
from shared prefixes as an online server would (scenarios/session_inference.py; a Mooncake
trace names no sessions): `session` ends a session idle longer than --session-idle-s of trace
time, `session-n` one not extended within --session-idle-requests later requests.
`session-ids` (only for a trace whose records carry session_id and session_end, as
multi_turn_trace --session-ids writes) takes the sessions the client names instead, each hot
from its first turn and dead as soon as the client releases it, as a server's named sessions
(prompt_cache_key, DELETE) would tell it; sessions never released end by the time rule.

Rows: each policy replayed; `belady` (the optimal at the same capacity, RAM + disk where a
disk tier is set); `lru+oracle` (LRU told which blocks are never used again, evicting those
first: the ceiling of any "evict private tails first" guess); `infinite`. With --oracles, two
ceilings of frequency-based policies: `lfu+oracle` (evicts the blocks with the fewest uses
over the whole trace, known in advance: perfect popularity) and `future+oracle` (the fewest
uses still to come).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sortedcontainers import SortedList

from radixkv.cache import BlockHasher, BlocksEvicted, CacheEvent, PagePool, RadixTree
from radixkv.cache.dead_blocks import DeadBlockPredictor
from radixkv.cache.kv_dtype import KV_STORAGE_DTYPES
from radixkv.cache.disk_index import DiskIndex
from radixkv.cache.eviction import EVICTION_POLICIES
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SequenceState
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scenarios.byte_budget import budget_report, parse_budgets
from radixkv.scenarios.plots import pyplot, save
from radixkv.scenarios.session_inference import IdleRule, SessionInference

TRACE_NAME = "synthetic_trace.jsonl"
# Replayed under the tree's `session` order with inferred sessions: by the idle rule's name.
SESSION_POLICIES = ("session", "session-n", "session-ids")
REPLAY_POLICIES = tuple(p for p in EVICTION_POLICIES if p != "session") + SESSION_POLICIES
# Replayed under the tree's `predict` order with the online dead-block predictor
# (cache/dead_blocks.py); `predict-ids` also takes the client's session ids and releases where
# the trace carries them.
PREDICT_POLICIES = ("predict", "predict-ids")
REPLAY_POLICIES += ("predict-ids",)
# Chosen on multi_turn_trace's calibration seed only (never on the held-out trace): a session
# idle this long is over. On that trace the hit ratio is flat from 450 s to 1200 s (a few mean
# think times) and from 3000 requests up; shorter rules end live sessions.
DEFAULT_SESSION_IDLE_S = 600.0
DEFAULT_SESSION_IDLE_REQUESTS = 3000


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: list[list[int]]  # hash_ids of each request, in trace order
    num_blocks: int  # block accesses over the trace
    num_distinct_blocks: int  # distinct blocks, each identified by its whole prefix
    arrivals_s: list[float] | None = None  # each request's timestamp in seconds; None: the trace has none
    # Where the records name sessions (session_id, session_end; not Mooncake's): each request's
    # session (None: none) and whether the client released it after that request.
    session_names: list[int | None] | None = None
    session_ends: list[bool] | None = None


@dataclass(frozen=True, slots=True)
class Row:
    kind: str  # "replay", "belady", "oracle" or "infinite"
    policy: str
    ram_fraction: float
    disk_fraction: float
    ram_blocks: int
    disk_blocks: int
    ram_hit_ratio: float
    disk_hit_ratio: float
    hit_ratio: float  # both tiers
    us_per_request: float  # the cache's own time (hashing, match, lock, evict, insert); replay only
    evicted_blocks: int = 0
    written_blocks: int = 0  # to the disk tier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=None, help=f"a Mooncake-format JSONL trace (default: shared/data/{TRACE_NAME})")
    parser.add_argument("--ram-fraction", default="0.05,0.1,0.25", help="RAM capacity as fractions of the distinct blocks, comma separated")
    parser.add_argument("--disk-fraction", default="0", help="disk tier capacity as fractions of the distinct blocks (0: none), comma separated")
    parser.add_argument("--policy", default=None, help=f"eviction policies, comma separated ({', '.join(REPLAY_POLICIES)}; default: all, session-ids where the trace names sessions)")
    parser.add_argument("--session-idle-s", type=float, default=DEFAULT_SESSION_IDLE_S, help="policy session: a session idle this long in trace time is over (its tail dead)")
    parser.add_argument("--session-idle-requests", type=int, default=DEFAULT_SESSION_IDLE_REQUESTS, help="policy session-n: a session not extended within this many later requests is over")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (each trace block is one page)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--oracles", action="store_true", help="add the frequency oracles (lfu+oracle, future+oracle) beside lru+oracle")
    parser.add_argument("--out", default="out/trace_replay", help="folder for trace_replay.json and .png")
    parser.add_argument("--ram-bytes", default=None, help="RAM budgets in bytes (suffix K, M, G: binary), comma separated; adds the kv-dtype table")
    parser.add_argument("--kv-dtype", default="bf16,int8", help=f"page storage dtypes for --ram-bytes, comma separated ({', '.join(KV_STORAGE_DTYPES)})")
    parser.add_argument("--kv-shape", default="30,3,64", help="layers,kv_heads,head_dim of the model whose KV a block holds (default: SmolLM2-135M)")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens one trace block stands for when pricing it in bytes (Mooncake: 512)")
    parser.add_argument("--kv-window", default=None, help="count:W: that many of --kv-shape's layers attend to a W-token window; adds window-aware pages against every layer keeping every token")
    args = parser.parse_args(argv)
    ram_fractions = _fractions(args.ram_fraction, "--ram-fraction", allow_zero=False)
    disk_fractions = _fractions(args.disk_fraction, "--disk-fraction", allow_zero=True)
    policies = [p.strip() for p in (args.policy or ",".join(REPLAY_POLICIES)).split(",") if p.strip()]
    unknown = sorted(set(policies) - set(REPLAY_POLICIES))
    if unknown:
        parser.error(f"unknown --policy {unknown}; known: {list(REPLAY_POLICIES)}")
    if args.session_idle_s <= 0 or args.session_idle_requests < 1:
        parser.error("--session-idle-s must be positive and --session-idle-requests at least 1")
    rules = {
        "session": IdleRule(idle_s=args.session_idle_s),
        "session-n": IdleRule(idle_requests=args.session_idle_requests),
        "session-ids": IdleRule(idle_s=args.session_idle_s),
    }

    path = resolve_trace(args.trace)
    trace = load_trace(path, args.limit)
    for named in ("session-ids", "predict-ids"):
        if trace.session_names is None and named in policies:
            if args.policy is not None:
                parser.error(f"--policy {named}: {trace.name} names no sessions (no session_id in its records)")
            policies.remove(named)
    print(
        f"{trace.name}: {len(trace.requests):,} requests, {trace.num_blocks:,} block accesses, "
        f"{trace.num_distinct_blocks:,} distinct blocks\n"
    )
    rows = [infinite_row(trace)]
    for ram_fraction in ram_fractions:
        ram_blocks = capacity(trace, ram_fraction)
        for disk_fraction in disk_fractions:
            disk_blocks = capacity(trace, disk_fraction) if disk_fraction else 0
            rows.append(belady_row(trace, ram_fraction, disk_fraction, ram_blocks, disk_blocks))
            if not disk_fraction:
                rows.append(oracle_row(trace, ram_fraction, ram_blocks))
                if args.oracles:
                    rows.append(oracle_row(trace, ram_fraction, ram_blocks, "popularity"))
                    rows.append(oracle_row(trace, ram_fraction, ram_blocks, "remaining"))
            for policy in policies:
                rows.append(replay(trace, policy, ram_fraction, disk_fraction, ram_blocks, disk_blocks, args.page_size, rules.get(policy)))
    print_table(rows)
    budget_rows, window_rows = (
        budget_report(parse_budgets(args, parser), trace, policies, args.page_size, replay) if args.ram_bytes else ([], [])
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "trace": str(path),
        "requests": len(trace.requests),
        "block_accesses": trace.num_blocks,
        "distinct_blocks": trace.num_distinct_blocks,
        "page_size": args.page_size,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": [asdict(row) for row in rows],
        "byte_budget": [asdict(row) for row in budget_rows],
        "window_budget": [asdict(row) for row in window_rows],
    }
    (out / "trace_replay.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, out / "trace_replay.png")
    print(f"\nwrote {out / 'trace_replay.json'} and {out / 'trace_replay.png'}")
    return 0


# --------------------------------------------------------------------------- the trace


def resolve_trace(given: str | None) -> Path:
    """The trace to replay: `given` if set, else the shared synthetic trace, looked for beside
    the repository (../shared/data), then in /work/shared/data."""
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise SystemExit(f"--trace {given}: no such file")
        return path
    here = Path(__file__).resolve()
    candidates = [parent / "shared" / "data" / TRACE_NAME for parent in here.parents]
    candidates += [Path.cwd().parent / "shared" / "data" / TRACE_NAME, Path("/work/shared/data") / TRACE_NAME]
    for path in candidates:
        if path.is_file():
            return path
    raise SystemExit(f"no {TRACE_NAME} found beside the repository or in /work/shared/data; pass --trace PATH")


def load_trace(path: Path, limit: int | None = None) -> Trace:
    requests: list[list[int]] = []
    arrivals_s: list[float] = []
    timed = True  # every record has a timestamp
    names: list[int | None] = []
    ends: list[bool] = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                hash_ids = record["hash_ids"]
                timestamp_ms = record.get("timestamp")
                name = record.get("session_id")
                names.append(None if name is None else int(name))
                ends.append(bool(record.get("session_end", False)))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise SystemExit(f"{path}:{number}: not a Mooncake trace record ({error})") from None
            requests.append([int(h) for h in hash_ids])
            timed = timed and timestamp_ms is not None
            if timed:
                arrivals_s.append(float(timestamp_ms) / 1000.0)
            if limit is not None and len(requests) >= limit:
                break
    ids = prefix_ids(requests)
    named = any(name is not None for name in names)
    return Trace(path.name, requests, sum(map(len, requests)), len({b for r in ids for b in r}), arrivals_s if timed else None,
        names if named else None, ends if named else None,
    )  # fmt: skip


def prefix_ids(requests: list[list[int]]) -> list[list[int]]:
    """Each block as a small int naming its whole prefix (the trace's ids need not)."""
    names: dict[tuple[int, int], int] = {}
    out = []
    for hash_ids in requests:
        parent, row = -1, []
        for h in hash_ids:
            parent = names.setdefault((parent, h), len(names))
            row.append(parent)
        out.append(row)
    return out


def capacity(trace: Trace, fraction: float) -> int:
    # A request's blocks must all fit while it runs (they are its pages), so never less.
    return max(round(trace.num_distinct_blocks * fraction), max(map(len, trace.requests)))


def block_tokens(hash_id: int, page_size: int) -> list[int]:
    """A fixed run of token ids for a trace block: distinct blocks get distinct runs."""
    base = hash_id * page_size
    return list(range(base, base + page_size))


# --------------------------------------------------------------------------- baselines


def infinite_row(trace: Trace) -> Row:
    seen: set[int] = set()
    hits = 0
    for row in prefix_ids(trace.requests):
        hits += _prefix_hits(row, seen)
        seen.update(row)
    ratio = hits / trace.num_blocks
    return Row("infinite", "-", 1.0, 0.0, trace.num_distinct_blocks, 0, ratio, 0.0, ratio, 0.0)


def belady_row(trace: Trace, ram_fraction: float, disk_fraction: float, ram_blocks: int, disk_blocks: int) -> Row:
    """Belady's optimal at the combined capacity (with a disk tier, an upper bound on both)."""
    ratio = belady_hit_ratio(prefix_ids(trace.requests), ram_blocks + disk_blocks)
    return Row("belady", "belady", ram_fraction, disk_fraction, ram_blocks, disk_blocks, ratio, 0.0, ratio, 0.0)


_ORACLE_NAMES = {"reuse": "lru+oracle", "popularity": "lfu+oracle", "remaining": "future+oracle"}


def oracle_row(trace: Trace, ram_fraction: float, ram_blocks: int, oracle: str = "reuse") -> Row:
    """A policy told something of the future (see belady_hit_ratio's `oracle`): the ceiling of
    any online policy that guesses it ("reuse": which blocks are never used again, the guess
    of "evict private tails first"; "popularity"/"remaining": how often a block is used,
    the guess of every frequency-based policy)."""
    ratio = belady_hit_ratio(prefix_ids(trace.requests), ram_blocks, oracle=oracle)
    return Row("oracle", _ORACLE_NAMES[oracle], ram_fraction, 0.0, ram_blocks, 0, ratio, 0.0, ratio, 0.0)


def belady_hit_ratio(requests: list[list[int]], capacity_blocks: int, oracle: str = "belady") -> float:
    """Prefix hits of a cache of `capacity_blocks` blocks that evicts the block used again
    farthest in the future (deepest first on ties, so a prefix outlives its extensions); with
    oracle="reuse", the least recently used among those never used again, else among all;
    "popularity": the one with the fewest uses over the whole trace, "remaining": the fewest
    uses still to come (least recently used first among equals, for both)."""
    uses: dict[int, list[int]] = defaultdict(list)
    for t, row in enumerate(requests):
        for block in row:
            uses[block].append(t)
    next_use = {block: 0 for block in uses}  # index into uses[block] of the next use
    never = len(requests)
    cached: dict[int, tuple] = {}
    order = SortedList()
    hits = total = 0
    for t, row in enumerate(requests):
        hits += _prefix_hits(row, cached)
        total += len(row)
        for block in row:
            if block in cached:
                order.remove(cached.pop(block))
            next_use[block] += 1
        while len(cached) + len(row) > capacity_blocks:
            victim = order.pop()
            del cached[victim[-1]]
        for depth, block in enumerate(row):
            use = uses[block]
            upcoming = use[next_use[block]] if next_use[block] < len(use) else never
            # order.pop() takes the largest key: for "reuse", never-again first, then the oldest.
            if oracle == "belady":
                key = (upcoming, depth, block)
            elif oracle == "reuse":
                key = (upcoming == never, -t, depth, block)
            elif oracle == "popularity":
                key = (-len(use), -t, depth, block)
            else:
                key = (next_use[block] - len(use), -t, depth, block)
            cached[block] = key
            order.add(key)
    return hits / total if total else 0.0


def _prefix_hits(row: Sequence[int], cached) -> int:
    hits = 0
    while hits < len(row) and row[hits] in cached:
        hits += 1
    return hits


# --------------------------------------------------------------------------- the replay


def replay(
    trace: Trace,
    policy: str,
    ram_fraction: float,
    disk_fraction: float,
    ram_blocks: int,
    disk_blocks: int,
    page_size: int,
    idle_rule: IdleRule | None = None,
) -> Row:
    """One policy's replay. A policy of SESSION_POLICIES runs the tree's `session` order with
    sessions inferred under `idle_rule` (its default for the policy when None)."""
    pool = PagePool(ram_blocks + 1, page_size)  # + the one-token tail's page
    hasher = BlockHasher(page_size, seed=0)
    disk = DiskIndex(disk_blocks) if disk_blocks else None
    written = [0]

    def write_back(event: CacheEvent) -> None:
        if not isinstance(event, BlocksEvicted):
            return
        # Block hashes name whole prefixes within this process: good keys for a simulated tier.
        for key in event.node.hashes:
            if disk.touch(key):
                continue  # inclusive tiers: a block read back from disk is still there
            disk.add(key, 1)
            written[0] += 1

    tree_policy = "session" if policy in SESSION_POLICIES else "predict" if policy in PREDICT_POLICIES else policy
    tree = RadixTree(pool, hasher, eviction_policy=tree_policy)
    if disk is not None:
        tree.events.subscribe(write_back)
    kv = KVManager(pool, tree, hasher, enable_prefix_caching=True)
    sessions = session_inference(trace, policy, tree, idle_rule)
    predictor = DeadBlockPredictor(lambda node, liveness, below: tree.set_liveness(node, liveness, below_blocks=below)) if policy in PREDICT_POLICIES else None
    named = policy == "predict-ids"
    params = SamplingParams(max_tokens=1)
    ram_hits = disk_hits = 0
    spent_s = 0.0
    for number, hash_ids in enumerate(trace.requests):
        prompt = [token for h in hash_ids for token in block_tokens(h, page_size)] + [0]
        seq = SequenceState(number, f"r{number}", 0, prompt, params, None, 0)
        start = time.perf_counter()
        if predictor is not None:
            ram, from_disk = serve_request(kv, disk, seq, lambda seq, hit: predictor.served(
                kv.block_hashes(seq), seq.tree_node, hit, trace.arrivals_s[number] if trace.arrivals_s else float(number),
                name=trace.session_names[number] if named else None, released=trace.session_ends[number] if named else False,
            ))  # fmt: skip
        elif sessions is None:
            ram, from_disk = serve_request(kv, disk, seq)
        else:
            ram, from_disk = serve_request(kv, disk, seq, lambda seq, hit: sessions.served(
                kv.block_hashes(seq), seq.tree_node, hit, trace.arrivals_s[number] if trace.arrivals_s else 0.0, number,
                name=trace.session_names[number] if sessions.named else None,
                released=trace.session_ends[number] if sessions.named else False,
            ))  # fmt: skip
        spent_s += time.perf_counter() - start
        ram_hits += ram
        disk_hits += from_disk
        if number % 500 == 0:
            tree.check_invariants()  # slow (O(nodes)): now and then, outside the timing
    tree.check_invariants()
    pool.check_invariants()
    total = trace.num_blocks
    return Row(
        "replay",
        policy,
        ram_fraction,
        disk_fraction,
        ram_blocks,
        disk_blocks,
        ram_hits / total,
        disk_hits / total,
        (ram_hits + disk_hits) / total,
        spent_s / len(trace.requests) * 1e6,
        tree.stats().evicted_pages,
        written[0],
    )


def session_inference(trace: Trace, policy: str, tree: RadixTree, idle_rule: IdleRule | None) -> SessionInference | None:
    """The session book a policy of SESSION_POLICIES replays with; None for the others."""
    if policy not in SESSION_POLICIES:
        return None
    if idle_rule is None:
        idle_rule = IdleRule(idle_requests=DEFAULT_SESSION_IDLE_REQUESTS) if policy == "session-n" else IdleRule(idle_s=DEFAULT_SESSION_IDLE_S)
    if idle_rule.idle_s is not None and trace.arrivals_s is None:
        raise SystemExit(f"policy {policy}: {trace.name} has no timestamps for an idle time; use session-n")
    named = policy == "session-ids"
    if named and (trace.session_names is None or trace.session_ends is None):
        raise SystemExit(f"policy session-ids: {trace.name} names no sessions (no session_id in its records)")
    return SessionInference(tree, idle_rule, named=named)


Committed = Callable[[SequenceState, int], None]  # (the committed sequence, its cached blocks)


def serve_request(kv: KVManager, disk: DiskIndex | None, seq: SequenceState, committed: Committed | None = None) -> tuple[int, int]:
    """One request through admission as the scheduler runs it (peek, check, then match, lock
    and allocate), computed at once, committed and finished; returns (RAM hit, disk hit) blocks.
    `committed` is told of the sequence while it still holds its node (a session book)."""
    ps = kv.cache_view().pool.page_size
    peek = kv.peek(seq)
    if not kv.can_admit(peek, seq.num_tokens - peek.num_cached_tokens):
        return 0, 0  # larger than RAM: computed without the cache (capacity() rules it out)
    ram_blocks = kv.admit(seq, seq.num_tokens - peek.num_cached_tokens).num_cached_tokens // ps
    disk_blocks = 0
    if disk is not None:
        hashes = kv.block_hashes(seq)
        limit = (seq.num_tokens - 1) // ps  # at least one token left to compute
        while ram_blocks + disk_blocks < limit and disk.touch(hashes[ram_blocks + disk_blocks]):
            disk_blocks += 1
    seq.num_computed_tokens = seq.num_tokens  # disk hits are loaded into their pages, the rest computed
    kv.commit(seq)
    if committed is not None:
        committed(seq, ram_blocks + disk_blocks)
    kv.release(seq)
    return ram_blocks, disk_blocks


# --------------------------------------------------------------------------- report


def print_table(rows: list[Row]) -> None:
    header = f"{'policy':<13} {'RAM':>6} {'disk':>6} {'RAM blocks':>10} {'disk blocks':>11} {'hit RAM':>8} {'hit disk':>8} {'hit all':>8} {'us/req':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        us = f"{row.us_per_request:8.0f}" if row.kind == "replay" else f"{'-':>8}"
        ram = "inf" if row.kind == "infinite" else f"{row.ram_fraction:.0%}"
        print(
            f"{row.policy if row.kind != 'infinite' else 'infinite':<13} {ram:>6} {row.disk_fraction:>6.0%} "
            f"{row.ram_blocks:>10,} {row.disk_blocks:>11,} {row.ram_hit_ratio:>8.3f} {row.disk_hit_ratio:>8.3f} "
            f"{row.hit_ratio:>8.3f} {us}"
        )


def plot(rows: list[Row], path: Path) -> None:
    plt = pyplot()

    infinite = next(row.hit_ratio for row in rows if row.kind == "infinite")
    groups = sorted({(row.ram_fraction, row.disk_fraction) for row in rows if row.kind != "infinite"})
    series = sorted({row.policy for row in rows if row.kind != "infinite"}, key=lambda p: (p == "belady" or "oracle" in p, p))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 4))
    width = 0.8 / max(1, len(series))
    for i, policy in enumerate(series):
        for g, group in enumerate(groups):
            row = next((r for r in rows if r.policy == policy and (r.ram_fraction, r.disk_fraction) == group), None)
            if row is None:
                continue
            x = g + (i - (len(series) - 1) / 2) * width
            ax.bar(x, row.ram_hit_ratio, width, color=f"C{i}", label=policy if g == 0 else None)
            if row.disk_hit_ratio:
                ax.bar(x, row.disk_hit_ratio, width, bottom=row.ram_hit_ratio, color=f"C{i}", alpha=0.45, hatch="//")
    ax.axhline(infinite, color="black", linestyle="--", linewidth=1, label=f"infinite {infinite:.2f}")
    ax.set_xticks(range(len(groups)), [f"RAM {r:.0%}" + (f"\n+disk {d:.0%}" if d else "") for r, d in groups])
    ax.set_ylabel("prefix-hit ratio (hatched: from disk)")
    ax.set_title("trace replay: prefix-hit ratio by capacity (fraction of distinct blocks; belady at RAM+disk)", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, path)


def _fractions(text: str, flag: str, *, allow_zero: bool) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated numbers, got {text!r}") from None
    low = 0.0 if allow_zero else 1e-9
    if not values or any(not low <= v <= 10.0 for v in values):
        raise SystemExit(f"{flag} values must be in [{0 if allow_zero else '>0'}, 10], got {text!r}")
    return values


if __name__ == "__main__":
    sys.exit(main())
