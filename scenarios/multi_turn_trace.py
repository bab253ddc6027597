"""A multi-turn chat trace in Mooncake's format (timestamp ms, input_length, output_length,
hash_ids of 512-token blocks), generated deterministically from a seed: sessions over a few
shared system prompts, each turn the previous turn's blocks plus the previous reply's and a new
user message's, interleaved in time with think times, plus one-shot requests.

    radixkv bench multi_turn_trace [--seed 20261205] [--out out/multi_turn_trace.jsonl]
    radixkv bench trace_replay --trace out/multi_turn_trace.jsonl

The shape (TraceShape) was calibrated on CALIBRATION_SEED only, so that at 5% of RAM
(trace_replay's smallest fraction) lru hits about 0.20 of prefix blocks and lru+oracle about
0.36, as issue 37 reports for its held-out trace; trace_replay's session idle rules were chosen
on the same seed. The evaluation trace is generated with DEFAULT_SEED, never tuned on (held
out). Think times are exponential and session lengths geometric past two turns: memoryless, so
an online policy learns nothing from a session's age that the idle rules do not already use.
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

    num_sessions: int = 2000
    num_system_prompts: int = 6
    system_prompt_blocks: tuple[int, int] = (2, 6)  # uniform range, inclusive
    first_user_blocks: tuple[int, int] = (2, 12)  # the first message (often a document)
    user_blocks: tuple[int, int] = (1, 3)  # a later turn's user message (or tool result)
    reply_blocks: tuple[int, int] = (1, 3)  # the previous reply, as the next turn re-sends it
    # Turns per session: this share ends after one turn, this after two, the rest run on
    # geometrically with the mean below (capped), so a few go long.
    one_turn_share: float = 0.25
    two_turn_share: float = 0.1
    long_mean_turns: float = 8.0
    max_turns: int = 40
    session_gap_ms: float = 700.0  # mean time between new sessions (Poisson)
    think_ms: float = 180_000.0  # mean time between a reply and the next turn (exponential)
    one_shot_share: float = 0.5  # of all requests: single requests outside any session
    one_shot_blocks: tuple[int, int] = (4, 32)
    one_shot_system_share: float = 0.5  # one-shots that start with a shared system prompt
    # A real trace's last block is partial (input_length is no multiple of 512): the next turn
    # re-sends it with more tokens, so its hash changes and the old last block is superseded.
    # False (the calibrated shape): every block is whole and a turn re-sends the previous one's
    # blocks exactly.
    partial_last_block: bool = False


# Named variants of the shape (--shape): the calibrated one; the same with partial last
# blocks, as a recorded trace has; and an AIPerf-style multi-turn benchmark (AIPerf's
# --conversation-num/--conversation-turn-mean/--conversation-turn-delay-mean with a shared
# system prompt pool: every request is a turn, no one-shots, shorter think times, fewer and
# longer conversations).
SHAPES = {
    "chat": TraceShape(),
    "chat-partial": TraceShape(partial_last_block=True),
    "aiperf": TraceShape(
        num_sessions=1500, num_system_prompts=2, system_prompt_blocks=(4, 8), first_user_blocks=(1, 4),
        one_turn_share=0.0, two_turn_share=0.0, long_mean_turns=6.0, max_turns=20, session_gap_ms=500.0,
        think_ms=20_000.0, one_shot_share=0.0, partial_last_block=True,
    ),
    "agent": TraceShape(
        num_sessions=800, num_system_prompts=3, system_prompt_blocks=(8, 16), first_user_blocks=(1, 4),
        user_blocks=(1, 6), reply_blocks=(1, 2), one_turn_share=0.1, two_turn_share=0.1, long_mean_turns=14.0,
        max_turns=60, session_gap_ms=1500.0, think_ms=8_000.0, one_shot_share=0.2, partial_last_block=True,
    ),
}


@dataclass(slots=True)
class TraceRecord:
    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: list[int]
    # Not Mooncake's: what a client that names its sessions tells the server (written only on
    # request, --session-ids). A one-shot has no session; session_end marks a session's last
    # turn (the client releases it after), never a turn the window cut short.
    session_id: int | None = None
    session_end: bool = False

    def to_json(self, with_sessions: bool = False) -> str:
        names = [f.name for f in fields(self) if with_sessions or f.name not in ("session_id", "session_end")]
        return json.dumps({name: getattr(self, name) for name in names})


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
    # (time ms, order, hash_ids, output tokens, session id or None, the session's last turn)
    events: list[tuple[float, int, list[int], int, int | None, bool]] = []
    order = 0
    start_ms = 0.0
    num_session_requests = 0
    for session_id in range(shape.num_sessions):
        start_ms += rng.expovariate(1.0 / shape.session_gap_ms)
        system = rng.choices(systems, weights)[0]
        hash_ids = system + ids.take(rng.randint(*shape.first_user_blocks))
        at_ms = start_ms
        num_turns = _num_turns(rng, shape)
        for turn in range(num_turns):
            if turn:
                reply, user = rng.randint(*shape.reply_blocks), rng.randint(*shape.user_blocks)
                if shape.partial_last_block:
                    hash_ids = hash_ids[:-1] + ids.take(1 + reply + user)
                else:
                    hash_ids = hash_ids + ids.take(reply + user)
                at_ms += rng.expovariate(1.0 / shape.think_ms)
            output_tokens = rng.randint(1, BLOCK_TOKENS * shape.reply_blocks[1])
            events.append((at_ms, order, hash_ids, output_tokens, session_id, turn == num_turns - 1))
            order += 1
            num_session_requests += 1
    # The trace is a window of time, as a recorded one is: it ends with the last session's
    # start, and the turns of sessions still going then are not in it. Without the cut a long
    # tail of a few long sessions would follow, a different workload from the window's.
    end_ms = start_ms
    events = [event for event in events if event[0] <= end_ms]
    num_session_requests = len(events)
    num_one_shots = round(num_session_requests * shape.one_shot_share / (1.0 - shape.one_shot_share))
    for _ in range(num_one_shots):
        prefix = rng.choices(systems, weights)[0] if rng.random() < shape.one_shot_system_share else []
        at_ms = rng.uniform(0.0, end_ms)
        hash_ids = prefix + ids.take(rng.randint(*shape.one_shot_blocks))
        events.append((at_ms, order, hash_ids, rng.randint(1, 512), None, False))
        order += 1
    events.sort(key=lambda event: (event[0], event[1]))
    return [
        TraceRecord(int(at_ms), len(hash_ids) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1), output_tokens, hash_ids, session, end)
        for at_ms, _, hash_ids, output_tokens, session, end in events
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


def write(records: list[TraceRecord], path: Path, with_sessions: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(record.to_json(with_sessions) + "\n" for record in records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"generation seed (default {DEFAULT_SEED}, held out; the shape was tuned on {CALIBRATION_SEED})")
    parser.add_argument("--out", default="out/multi_turn_trace.jsonl", help="the JSONL file to write")
    parser.add_argument("--session-ids", action="store_true", help="add session_id and session_end to each record (what a client naming its sessions sends)")
    parser.add_argument("--shape", default="chat", choices=sorted(SHAPES), help="the trace's shape (default chat: the calibrated one)")
    args = parser.parse_args(argv)
    records = generate(args.seed, SHAPES[args.shape])
    write(records, Path(args.out), args.session_ids)
    print(f"wrote {Path(args.out)}: {len(records):,} requests over {records[-1].timestamp / 1000:,.0f} s, seed {args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
