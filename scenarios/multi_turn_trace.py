"""A multi-turn chat trace in Mooncake's format (timestamp ms, input_length, output_length,
hash_ids of 512-token blocks), generated deterministically from a seed: sessions over a few
shared system prompts, each turn the previous turn's blocks plus the previous reply's and a new
user message's, interleaved in time with think times, plus one-shot requests.

    radixkv bench multi_turn_trace [--seed 20261205] [--out out/multi_turn_trace.jsonl]

The shape (TraceShape) was calibrated on seed 1 only, so that at 5% of RAM (trace_replay's
smallest fraction) lru hits about 0.20 of prefix blocks and lru+oracle about 0.36, as issue 37
reports; the evaluation trace is generated with DEFAULT_SEED, never tuned on (held out).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

BLOCK_TOKENS = 512  # Mooncake's block
# The seed of the evaluation trace: the shape was tuned on CALIBRATION_SEED alone.
DEFAULT_SEED = 20261205
CALIBRATION_SEED = 1


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What a trace is made of; the defaults are the calibrated shape."""

    num_sessions: int = 900
    num_system_prompts: int = 4
    system_prompt_blocks: tuple[int, int] = (2, 8)  # uniform range, inclusive
    first_user_blocks: tuple[int, int] = (1, 6)
    user_blocks: tuple[int, int] = (1, 3)  # a later turn's user message (or tool result)
    reply_blocks: tuple[int, int] = (1, 3)  # the previous reply, as the next turn re-sends it
    # Turns per session: this share ends after one turn, this after two, the rest run on
    # geometrically with the mean below (capped), so a few go long.
    one_turn_share: float = 0.35
    two_turn_share: float = 0.2
    long_mean_turns: float = 8.0
    max_turns: int = 40
    session_gap_ms: float = 4_000.0  # mean time between new sessions (Poisson)
    think_ms: float = 45_000.0  # mean time between a reply and the next turn (exponential)
    one_shot_share: float = 0.25  # of all requests: single requests outside any session
    one_shot_blocks: tuple[int, int] = (2, 24)
    one_shot_system_share: float = 0.5  # one-shots that start with a shared system prompt


@dataclass(slots=True)
class TraceRecord:
    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: list[int]

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self, num: int) -> list[int]:
        ids = list(range(self.next, self.next + num))
        self.next += num
        return ids


def generate(seed: int = DEFAULT_SEED, shape: TraceShape = TraceShape()) -> list[TraceRecord]:
    """The trace for `seed`, in time order (ties in generation order)."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [ids.take(rng.randint(*shape.system_prompt_blocks)) for _ in range(shape.num_system_prompts)]
    # Zipf-like popularity of the system prompts: a few agents get most sessions.
    weights = [1.0 / (rank + 1) for rank in range(len(systems))]
    events: list[tuple[float, int, list[int], int]] = []  # (time ms, order, hash_ids, output tokens)
    order = 0
    start_ms = 0.0
    num_session_requests = 0
    for _ in range(shape.num_sessions):
        start_ms += rng.expovariate(1.0 / shape.session_gap_ms)
        system = rng.choices(systems, weights)[0]
        hash_ids = system + ids.take(rng.randint(*shape.first_user_blocks))
        at_ms = start_ms
        for turn in range(_num_turns(rng, shape)):
            if turn:
                reply, user = rng.randint(*shape.reply_blocks), rng.randint(*shape.user_blocks)
                hash_ids = hash_ids + ids.take(reply + user)
                at_ms += rng.expovariate(1.0 / shape.think_ms)
            output_tokens = rng.randint(1, BLOCK_TOKENS * shape.reply_blocks[1])
            events.append((at_ms, order, hash_ids, output_tokens))
            order += 1
            num_session_requests += 1
    end_ms = max(event[0] for event in events)
    num_one_shots = round(num_session_requests * shape.one_shot_share / (1.0 - shape.one_shot_share))
    for _ in range(num_one_shots):
        prefix = rng.choices(systems, weights)[0] if rng.random() < shape.one_shot_system_share else []
        events.append((rng.uniform(0.0, end_ms), order, prefix + ids.take(rng.randint(*shape.one_shot_blocks)), rng.randint(1, 512)))
        order += 1
    events.sort(key=lambda event: (event[0], event[1]))
    return [
        TraceRecord(int(at_ms), len(hash_ids) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1), output_tokens, hash_ids)
        for at_ms, _, hash_ids, output_tokens in events
    ]


def _num_turns(rng: random.Random, shape: TraceShape) -> int:
    draw = rng.random()
    if draw < shape.one_turn_share:
        return 1
    if draw < shape.one_turn_share + shape.two_turn_share:
        return 2
    # Geometric on 3, 4, ... with the given mean.
    p = 1.0 / max(1.0, shape.long_mean_turns - 2.0)
    turns = 3
    while turns < shape.max_turns and rng.random() > p:
        turns += 1
    return turns


def write(records: list[TraceRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(record.to_json() + "\n" for record in records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"generation seed (default {DEFAULT_SEED}, held out; the shape was tuned on {CALIBRATION_SEED})")
    parser.add_argument("--out", default="out/multi_turn_trace.jsonl", help="the JSONL file to write")
    args = parser.parse_args(argv)
    records = generate(args.seed)
    write(records, Path(args.out))
    sessions = sum(1 for record in records if record.hash_ids)  # every record has blocks
    print(f"wrote {Path(args.out)}: {len(records):,} requests ({sessions:,} with blocks), seed {args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
