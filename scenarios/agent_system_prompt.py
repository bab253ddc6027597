"""Agent system prompt: groups of requests share a long system prompt, each with a short
distinct question (SGLang's generated-shared-prefix shape, scaled for a 2-core CPU).

    python -m radixkv.scenarios.agent_system_prompt [--groups 4 --system-len 1024 --question-len 64 ...]
"""

from __future__ import annotations

import sys

from radixkv.scenarios.bounds import Costs, workload_bound_s
from radixkv.scenarios.harness import load_tokenizer, parse_args, peer_list, run, text_tokens
from radixkv.scenarios.machine import machine_limits
from radixkv.scenarios.peers import Workload
from radixkv.scenarios.report import min_prefill_tokens

DEFAULTS = dict(
    name="agent_system_prompt",
    num_requests=64,
    output_len=32,
    extra={
        "groups": (int, 4, "distinct system prompts"),
        "system-len": (int, 1024, "tokens of each system prompt"),
        "question-len": (int, 64, "tokens of each question"),
        "decode-profile": (int, 1, "1: also time one decode step of 32 requests and say where the time goes"),
    },
)


def build(args) -> Workload:
    tokenizer = load_tokenizer(args.model)
    prompts = []
    for i in range(args.num_requests):
        group = i % args.groups
        system = text_tokens(tokenizer, args.system_len, offset=97 * group)
        question = text_tokens(tokenizer, args.question_len, offset=1000 + 37 * i)
        prompts.append(system + question)
    return Workload(DEFAULTS["name"], prompts, args.output_len, model=args.model, dtype=args.dtype, device=args.device)


def bound(workload: Workload, max_num_seqs: int = 64) -> dict:
    """The workload's bound on this machine, in the dtype radixkv's `auto` picks here."""
    from radixkv.model import load_model_config, resolve_device, resolve_dtype

    dtype = resolve_dtype(workload.dtype, resolve_device("cpu"))
    limits = machine_limits(dtype)
    costs = Costs.of(load_model_config(workload.model), element_bytes=dtype.itemsize)
    distinct = min_prefill_tokens(workload.prompts, workload.page_size)
    seconds = workload_bound_s(
        costs, [len(p) for p in workload.prompts], distinct, workload.output_len, max_num_seqs,
        limits["read_bandwidth_gb_s"] * 1e9, limits["matmul_gflops"] * 1e9,
    )  # fmt: skip
    return limits | seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__, DEFAULTS)
    workload = build(args)

    def after() -> dict:
        from radixkv.model import resolve_device

        if resolve_device(workload.device).type != "cpu":
            return {}  # the bound and the decode profile measure a CPU's limits and kernels
        extra = {"bound": bound(workload)}
        if args.decode_profile:
            from radixkv.scenarios.decode_profile import profile_decode

            extra["decode_profile"] = profile_decode(args.model, args.dtype)
        return extra

    run(workload, peer_list(args.peers), args.out, after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
