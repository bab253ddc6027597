"""What cache reports cost: the engine's share per request (MissExplainer.explain at admission,
the partial-tail record at release), the server's part lookup for a chat of many messages, and
the ghost index's memory per remembered block.

    python -m scenarios.cache_report_cost [--model DIR] [--prompt-tokens 512] [--requests 12]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from radixkv import LLM, SamplingParams
from radixkv.cache.ghost import GhostIndex
from radixkv.engine.cache_report import MissExplainer


def _timed(owner: Any, name: str, spent: list[float]) -> None:
    """Wrap owner.name so each call's seconds are appended to `spent`."""
    real: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def engine_share(llm: LLM, prompt_tokens: int, requests: int) -> dict[str, float]:
    """Seconds per request in the report's engine work, over repeats, fresh prompts and
    prompts evicted since (their reasons: hit, never_seen, evicted)."""
    misses: MissExplainer = llm.engine.cache_view.misses  # timed in place, through the view's parts
    explain: list[float] = []
    tails: list[float] = []
    _timed(misses, "explain", explain)
    _timed(misses, "remember_tail", tails)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(requests // 2)]
    one = SamplingParams(max_tokens=1)
    started = time.perf_counter()
    for prompt in prompts + prompts[::-1]:  # the latest are still cached, the earliest evicted
        llm.generate([prompt], one)
    total = time.perf_counter() - started
    counts = llm.stats().cache_misses or {}
    return {
        "requests": len(explain),
        "explain_us": 1e6 * sum(explain) / max(len(explain), 1),
        "tail_us": 1e6 * sum(tails) / max(len(tails), 1),
        "request_ms": 1e3 * total / max(len(explain), 1),
        **{f"n_{reason}": float(count) for reason, count in counts.items() if count},
    }


def locate_share(llm: LLM, messages: int) -> dict[str, float]:
    """Seconds to find the part of a chat's first uncached token (server/cache_report.locate)."""
    from radixkv.server.cache_report import ChatSource, locate
    from radixkv.prompts.tools import encode_conversation

    rng = random.Random(1)
    words = "apple river stone cloud garden window yellow music paper forest silver ocean".split()
    chat = [{"role": "user" if k % 2 == 0 else "assistant", "content": " ".join(rng.choice(words) for _ in range(30))} for k in range(messages)]
    tokenizer = llm.tokenizer
    prompt = encode_conversation(tokenizer, chat, [], "none")
    source = ChatSource(chat, [], "none")
    runs = 5
    started = time.perf_counter()
    for i in range(runs):
        locate(tokenizer, source, prompt, (i + 1) * len(prompt) // (runs + 1))
    return {"messages": messages, "prompt_tokens": len(prompt), "locate_ms": 1e3 * (time.perf_counter() - started) / runs}


def ghost_bytes(blocks: int = 100_000) -> float:
    """Bytes of memory per block the ghost index remembers (128-bit hashes)."""
    rng = random.Random(2)
    hashes = [rng.getrandbits(128) for _ in range(blocks)]
    tracemalloc.start()
    ghost = GhostIndex(blocks)
    ghost.add(hashes)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return current / blocks  # the ints themselves are the caller's hashes, held anyway by the tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an HF folder or .gguf; default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--messages", type=int, default=32)
    parser.add_argument("--num-pages", type=int, default=None, help="default: room for a third of the prompts (so some are evicted)")
    args = parser.parse_args(argv)
    page_size = 16
    num_pages = args.num_pages or max(8, args.requests // 6 * (args.prompt_tokens // page_size + 2))
    llm = LLM(args.model, dtype=args.dtype, device="cpu", num_pages=num_pages, page_size=page_size, weight_dtype="float")
    if not getattr(llm.tokenizer, "chat_template", None):
        llm.tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    engine = engine_share(llm, args.prompt_tokens, args.requests)
    parts = locate_share(llm, args.messages)
    print(f"cache_report_cost: {args.prompt_tokens}-token prompts, {num_pages} pages of {page_size}")
    print(f"  engine, per request: explain {engine['explain_us']:.1f} us, tail record {engine['tail_us']:.1f} us"
          f" (a whole request {engine['request_ms']:.1f} ms); reasons {({k[2:]: int(v) for k, v in engine.items() if k.startswith('n_')})}")  # fmt: skip
    print(f"  server, per reported chat: locate {parts['locate_ms']:.2f} ms ({parts['messages']} messages, {parts['prompt_tokens']} tokens)")
    print(f"  ghost index: {ghost_bytes():.0f} bytes per remembered block")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
