"""A parent agent fans out to subagents over one long prefix, under memory pressure: the parent's
turn, then --children subagents (each a turn and a final turn of its own, --concurrency at once)
whose prompts start with the parent's, then other tenants' traffic that turns the pool over; the
parent's next turn's cached share, with and without sessions (a child names its parent with
X-Dynamo-Parent-Session-ID, engine/sessions.py; its final turn releases its private tail).

    radixkv bench subagent_fanout [--prefix-len 1024] [--children 8] [--others 6] [--model PATH] [--out out/subagent_fanout]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.scenarios.harness import text_tokens
from radixkv.scenarios.machine import cpu_model

OWNER = "agent-tenant"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens of the parent's prefix every child starts with")
    parser.add_argument("--children", type=int, default=8)
    parser.add_argument("--child-len", type=int, default=256, help="tokens of each child's own task, and again of its final turn")
    parser.add_argument("--reply-len", type=int, default=16, help="tokens of each reply (end of sequence ignored)")
    parser.add_argument("--concurrency", type=int, default=4, help="children running at once")
    parser.add_argument("--others", type=int, default=6, help="other tenants' prompts after the children end")
    parser.add_argument("--other-len", type=int, default=512)
    parser.add_argument("--policy", default=None, help="the eviction policy (EngineConfig.eviction_policy; default its default)")
    parser.add_argument("--pool-contexts", type=float, default=2.5, help="the page pool, in the longest child's contexts")
    parser.add_argument("--out", default="out/subagent_fanout")
    args = parser.parse_args(argv)

    from radixkv.engine.build import load_engine_model
    from radixkv.model.device import resolve_device

    child_context = args.prefix_len + args.reply_len + 2 * (args.child_len + args.reply_len) + 8
    base = EngineConfig(model=args.model, dtype=args.dtype, max_model_len=max(child_context, args.other_len) + 8)
    num_pages = max(8, int(args.pool_contexts * child_context / base.page_size))
    base = replace(base, num_pages=num_pages, **({"eviction_policy": args.policy} if args.policy else {}))
    loaded = load_engine_model(base, resolve_device(base.device))
    tokenizer = loaded.tokenizer

    runs = {}
    for name, sessions in (("without sessions", False), ("parent and child sessions", True)):
        engine = Engine(base, loaded=loaded)
        runs[name] = _fan_out(engine, tokenizer, args, sessions)
        del engine

    print(f"{cpu_model()}; model {loaded.path} {loaded.dtype}; pool {num_pages} pages of {base.page_size} tokens "
          f"({num_pages * base.page_size:,} tokens), eviction {base.eviction_policy}; prefix {args.prefix_len} tokens, {args.children} children "
          f"({args.concurrency} at once), then {args.others} other prompts of {args.other_len} tokens\n")
    print(f"{'run':<26} {'children cached':>15} {'parent resume cached':>21} {'of prefix':>9} {'TTFT s':>8}")
    for name, run in runs.items():
        print(f"{name:<26} {run['children_cached_share']:>15.2f} {run['parent_cached_tokens']:>21,} "
              f"{run['parent_prefix_share']:>9.2f} {run['parent_ttft_s']:>8.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": loaded.path, "dtype": str(loaded.dtype), "cpu": cpu_model(), "machine": platform.machine(),
        "page_size": base.page_size, "num_pages": num_pages, "eviction_policy": base.eviction_policy, "args": vars(args), "runs": runs,
    }  # fmt: skip
    (out / "subagent_fanout.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'subagent_fanout.json'}")
    return 0


def _fan_out(engine: Engine, tokenizer, args: argparse.Namespace, sessions: bool) -> dict:
    """The parent's turn, its children (--concurrency at once, each a turn then a final turn),
    other traffic, the parent's next turn; what each found cached."""
    parent_ref = SessionRef(OWNER, "parent") if sessions else None
    prefix = text_tokens(tokenizer, args.prefix_len)
    params = SamplingParams(max_tokens=args.reply_len, ignore_eos=True)
    parent = _run_all(engine, [(prefix, parent_ref)], params)[0]
    prefix = prefix + parent.outputs[0].token_ids  # the parent's turn as the cache holds it
    firsts: list[RequestOutput] = []
    finals: list[RequestOutput] = []
    for start in range(0, args.children, args.concurrency):
        batch = range(start, min(args.children, start + args.concurrency))
        refs = {c: SessionRef(OWNER, f"child-{c}", parent="parent") if sessions else None for c in batch}
        prompts = {c: prefix + text_tokens(tokenizer, args.child_len, offset=7919 * (c + 1)) for c in batch}
        done = _run_all(engine, [(prompts[c], refs[c]) for c in batch], params)
        firsts += done
        last = [
            (prompts[c] + out.outputs[0].token_ids + text_tokens(tokenizer, args.child_len, offset=104729 * (c + 1)),
             replace(refs[c], final=True) if refs[c] is not None else None)
            for c, out in zip(batch, done)
        ]  # fmt: skip
        finals += _run_all(engine, last, params)
    for i in range(args.others):  # other tenants turn the pool over, one at a time
        other = text_tokens(tokenizer, args.other_len, offset=15485863 + 613 * i)
        _run_all(engine, [(other, None)], SamplingParams(max_tokens=1), owner=f"tenant-{i}", salt=f"tenant-{i}")
    resume = _run_all(engine, [(prefix + text_tokens(tokenizer, 32, offset=999), parent_ref)], SamplingParams(max_tokens=1))[0]
    return {
        "children_cached_share": sum(o.num_cached_tokens / o.num_prompt_tokens for o in firsts) / max(1, len(firsts)),
        "children_final_cached_share": sum(o.num_cached_tokens / o.num_prompt_tokens for o in finals) / max(1, len(finals)),
        "prefix_tokens": len(prefix),
        "parent_cached_tokens": resume.num_cached_tokens,
        "parent_prefix_share": min(1.0, resume.num_cached_tokens / len(prefix)),
        "parent_ttft_s": resume.time_to_first_token_s,
        "sessions_left": [s.key for s in engine.sessions.of_owner(OWNER)],
    }


def _run_all(
    engine: Engine, requests: list[tuple[list[int], SessionRef | None]], params: SamplingParams, owner: str = OWNER,
    salt: str | None = None,
) -> list[RequestOutput]:
    """Run the requests together to their ends; their outputs in order (TTFT: the whole request
    where none was sampled)."""
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params, session=ref, owner=owner, salt=salt) for prompt, ref in requests]
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        for delta in engine.step():
            if delta.finished and delta.output is not None:
                done[delta.request_id] = delta.output
    for output in done.values():
        if output.time_to_first_token_s is None:
            output.time_to_first_token_s = time.perf_counter() - start
    return [done[request_id] for request_id in ids]


if __name__ == "__main__":
    sys.exit(main())
