"""`make demo`: the default model on a batch of requests that share a long system prompt.

Prints each request's prompt and cached tokens, then the wall time of the same batch with the
prefix cache on and off, measured in one run.
"""

from __future__ import annotations

import argparse
import time

from radixkv import LLM, SamplingParams

SYSTEM_PROMPT = (
    "You are Atlas, the support assistant of a company that sells bicycles, e-bikes and spare parts online. "
    "Follow these rules in every answer. Be brief: two or three sentences unless the customer asks for more. "
    "Never invent order numbers, prices or delivery dates; if you do not know, say so and offer to connect "
    "the customer with a human agent. Orders ship within two working days from the warehouse in Lyon; "
    "delivery in the European Union takes three to five working days and costs nine euros, free above one "
    "hundred euros. Returns are accepted within thirty days if the product is unused and in its original "
    "packaging; e-bike batteries can only be returned sealed. Warranty: two years on all parts, five years "
    "on frames. The workshop services e-bikes by appointment only. Payment by card, bank transfer or PayPal. "
    "When a customer reports a safety problem, such as brakes that fail or a battery that overheats, tell "
    "them to stop riding immediately and to contact the workshop. Do not give medical or legal advice. "
    "Answer in the language of the customer. Sign each reply with the name Atlas. "
) * 2

QUESTIONS = [
    "How long does delivery to Germany take?",
    "Can I return a battery I opened?",
    "My brakes squeak and feel weak. What should I do?",
    "Do you accept PayPal?",
    "What is the warranty on a carbon frame?",
    "Is shipping free for an order of 120 euros?",
    "Can I bring my e-bike to the workshop tomorrow without calling?",
    "Where do orders ship from?",
]


def run(llm: LLM, params: SamplingParams) -> tuple[float, list]:
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
        help="bit-identical outputs with and without the cache (slower); default: on for quantized weights",
    )
    parser.add_argument("--model", default=None, help="a model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    invariant = args.batch_invariant
    params = SamplingParams(max_tokens=24)
    print(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'}...")
    cached_llm = LLM(args.model, batch_invariant=invariant)
    # Warm-up: first-call overheads off the clock, a decode step too (on a GPU, Triton compiles
    # each kernel on its first launch).
    run(cached_llm, SamplingParams(max_tokens=2))
    cached_llm.engine.tree.reset()
    computed_before = cached_llm.stats().counters.num_prompt_tokens_computed
    cached_time, outputs = run(cached_llm, params)
    cached_computed = cached_llm.stats().counters.num_prompt_tokens_computed - computed_before
    print(f"\n{'request':<60} {'prompt':>7} {'cached':>7}")
    for question, output in zip(QUESTIONS, outputs):
        print(f"{question:<60} {output.num_prompt_tokens:>7} {output.num_cached_tokens:>7}")
    print(f"\nfirst answer: {outputs[0].text.strip()!r}")

    uncached_llm = LLM(args.model, enable_prefix_caching=False, batch_invariant=invariant)
    run(uncached_llm, SamplingParams(max_tokens=2))
    computed_before = uncached_llm.stats().counters.num_prompt_tokens_computed
    uncached_time, uncached_outputs = run(uncached_llm, params)
    uncached_computed = uncached_llm.stats().counters.num_prompt_tokens_computed - computed_before
    same = sum(a.token_ids == b.token_ids for a, b in zip(outputs, uncached_outputs))
    print(f"\nwall time, prefix cache on : {cached_time:6.2f} s  (prompt tokens computed: {cached_computed})")
    print(f"wall time, prefix cache off: {uncached_time:6.2f} s  (prompt tokens computed: {uncached_computed})")
    print(f"speed-up: {uncached_time / cached_time:.2f}x; identical outputs: {same}/{len(outputs)} ({cached_llm.engine.dtype} on {cached_llm.engine.device})")
    if same < len(outputs):
        print(
            "  (steps are not batch-invariant by default: prefill attention splits a prompt's keys where\n"
            "   the step's new tokens start (and matmul libraries pick kernels by row count), rounding\n"
            "   differently, so a suffix computed over a cached prefix can differ in the last bit and flip\n"
            "   a near-tie. Quantized weights run batch-invariant by default for that reason; `python -m\n"
            "   radixkv.demo --batch-invariant` (LLM(batch_invariant=True)) makes any model bit-identical on CPU)"
        )


if __name__ == "__main__":
    main()
