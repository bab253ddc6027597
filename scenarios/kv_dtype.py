"""KV pages stored apart from the compute dtype (EngineConfig.kv_dtype), measured on CPU:

- decode step: the native paged-decode kernel under fp32 compute over fp32, bf16 and int8 pages
  (32 requests x 1,024 tokens, 8 KV heads of 64, 4 query heads each, --layers layers' pages,
  caches cold), with the bytes each reads and its rate;
- divergence on the default model (SmolLM2-135M, fp32 compute): greedy tokens with bf16 and int8
  pages against fp32 pages, per prompt the first token that differs, and the largest logit
  difference over prompt + fp32 continuation fed through the model (teacher forcing) with each
  kind of page.

    python scenarios/kv_dtype.py [--out out/kv_dtype] [--repeats 5] [--layers 4] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from radixkv.attention.base import AttentionMetadata
from radixkv.attention.cpu_backend import CPUBackend
from radixkv.attention.torch_backend import store_by_index_copy
from radixkv.cache.kv_dtype import KV_STORAGE_DTYPES
from radixkv.cache.pages import PagePool
from radixkv.cpu import decode as cpu_decode
from radixkv.cpu import native
from radixkv.scenarios.cpu_kernels import coldest

KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 8, 4, 64, 16
PAGE_DTYPES = ("fp32", "bf16", "int8")
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100 and say why each is prime.",
    "Translate to French: The cat sleeps on the warm windowsill.",
)


def decode_rows(repeats: int, flush: torch.Tensor, layers: int, context: int, num_seqs: int) -> list[dict]:
    """One decode step's attention over `layers` layers of pages in each storage dtype."""
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq
    page_table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0), dtype=torch.int32).view(num_seqs, pages_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q = torch.randn(num_seqs, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    rows, base = [], None
    for name in PAGE_DTYPES:
        pool = PagePool(num_pages, PAGE_SIZE, layers, KV_HEADS, HEAD_DIM, KV_STORAGE_DTYPES[name])
        pool.allocate(num_pages)
        generator = torch.Generator().manual_seed(2)
        slots = torch.arange(num_pages * PAGE_SIZE)
        for layer in range(layers):
            k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=generator)
            v = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=generator)
            scales = (pool.k_scales[layer], pool.v_scales[layer]) if pool.k_scales else (None, None)
            store_by_index_copy(k, v, pool.k_cache[layer], pool.v_cache[layer], slots, *scales)
        assert cpu_decode.pages_fit(torch.float32, pool.k_cache[0])

        def step(pool: PagePool = pool) -> None:
            for layer in range(layers):
                scales = (pool.k_scales[layer], pool.v_scales[layer]) if pool.k_scales else (None, None)
                cpu_decode.paged_decode(q, pool.k_cache[layer], pool.v_cache[layer], page_table, seq_lens, HEAD_DIM**-0.5,
                                        k_scales=scales[0], v_scales=scales[1])  # fmt: skip

        seconds = coldest(step, repeats, flush)
        base = base or seconds
        read_bytes = layers * num_seqs * context * pool.page_nbytes // (layers * PAGE_SIZE)
        rows.append(dict(pages=name, case=f"{num_seqs} x {context} tokens, {layers} layers", ms=seconds * 1e3,
                         read_mib=read_bytes / 2**20, gb_s=read_bytes / seconds / 1e9, x_fp32=seconds / base))  # fmt: skip
    return rows


def greedy_divergence(new_tokens: int) -> tuple[list[dict], list[list[int]], list[list[int]]]:
    """Greedy continuations of PROMPTS with each page dtype against fp32 pages: the first output
    position that differs (None: none within new_tokens)."""
    from radixkv import LLM, SamplingParams

    outputs = {}
    for name in PAGE_DTYPES:
        llm = LLM(dtype="float32", kv_dtype=name, attention_backend="cpu", seed=0)
        tokenizer = llm.engine.tokenizer
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in PROMPTS]
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        results = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        outputs[name] = ([r.token_ids for r in results], prompts)
        llm.close()
    rows = []
    reference, prompts = outputs["fp32"]
    for name in PAGE_DTYPES[1:]:
        for i, (want, got) in enumerate(zip(reference, outputs[name][0], strict=True)):
            first = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
            rows.append(dict(pages=name, prompt=i, prompt_tokens=len(prompts[i]), first_difference=first, compared=len(want)))
    return rows, reference, prompts


def logit_divergence(prompts: list[list[int]], continuations: list[list[int]]) -> list[dict]:
    """Each prompt + its fp32 continuation through the model in one prefill step over pages of
    each dtype: the largest |logit difference| to fp32 pages over every position."""
    from radixkv.model import load_model

    loaded = load_model(None, CPUBackend(), dtype="float32", device="cpu")
    config = loaded.config
    rows = []
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
        tokens = prompt + continuation
        logits = {}
        for name in PAGE_DTYPES:
            num_pages = -(-len(tokens) // PAGE_SIZE)
            pool = PagePool(num_pages, PAGE_SIZE, config.num_layers, config.num_kv_heads, config.head_dim, KV_STORAGE_DTYPES[name])
            pool.allocate(num_pages)
            meta = _prefill_metadata(len(tokens), num_pages)
            with torch.inference_mode():
                logits[name] = loaded.model(
                    torch.tensor(tokens), meta.positions, meta, pool.k_cache, pool.v_cache, torch.arange(len(tokens)),
                    pool.k_scales or None, pool.v_scales or None,
                )  # fmt: skip
        for name in PAGE_DTYPES[1:]:
            diff = (logits[name] - logits["fp32"]).abs()
            rows.append(dict(pages=name, prompt=i, positions=len(tokens), max_logit_diff=float(diff.max()),
                             mean_logit_diff=float(diff.mean()),
                             argmax_agree=float((logits[name].argmax(-1) == logits["fp32"].argmax(-1)).float().mean())))  # fmt: skip
    return rows


def _prefill_metadata(num_tokens: int, num_pages: int) -> AttentionMetadata:
    """One request computing all its tokens in pages 0..num_pages-1."""
    return AttentionMetadata(
        positions=torch.arange(num_tokens), slot_mapping=torch.arange(num_tokens),
        page_table=torch.arange(num_pages, dtype=torch.int32)[None], cu_q_lens=torch.tensor([0, num_tokens], dtype=torch.int32),
        q_lens=torch.tensor([num_tokens], dtype=torch.int32), seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        prefix_lens=torch.tensor([0], dtype=torch.int32), max_q_len=num_tokens, max_seq_len=num_tokens,
        page_size=PAGE_SIZE, q_lens_list=[num_tokens], seq_lens_list=[num_tokens],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/kv_dtype")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4, help="layers of pages one timed step reads")
    parser.add_argument("--context", type=int, default=1024, help="tokens of each decoding request")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt for the divergence")
    parser.add_argument("--flush-mib", type=int, default=512, help="buffer read before each timing to empty the caches")
    parser.add_argument("--skip-model", action="store_true", help="only the kernel timing (no default model)")
    args = parser.parse_args(argv)
    if native.load() is None:
        print("needs the native kernels (no C compiler here)")
        return 1
    flush = torch.ones(args.flush_mib << 20, dtype=torch.int8)
    results: dict[str, list[dict]] = {"decode": decode_rows(args.repeats, flush, args.layers, args.context, args.num_seqs)}
    print(f"\n{'pages':<6} {'case':<32} {'ms':>8} {'MiB read':>9} {'GB/s':>7} {'x fp32':>7}")
    for r in results["decode"]:
        print(f"{r['pages']:<6} {r['case']:<32} {r['ms']:8.2f} {r['read_mib']:9.1f} {r['gb_s']:7.1f} {r['x_fp32']:7.2f}")
    if not args.skip_model:
        greedy, continuations, prompts = greedy_divergence(args.new_tokens)
        results["greedy"] = greedy
        results["logits"] = logit_divergence(prompts, continuations)
        print(f"\n{'pages':<6} {'prompt':>6} {'prompt tokens':>13} {'first differing token':>22} {'of':>4}")
        for r in greedy:
            first = "none" if r["first_difference"] is None else str(r["first_difference"])
            print(f"{r['pages']:<6} {r['prompt']:>6} {r['prompt_tokens']:>13} {first:>22} {r['compared']:>4}")
        print(f"\n{'pages':<6} {'prompt':>6} {'positions':>9} {'max |dlogit|':>13} {'mean |dlogit|':>14} {'argmax agree':>13}")
        for r in results["logits"]:
            print(f"{r['pages']:<6} {r['prompt']:>6} {r['positions']:>9} {r['max_logit_diff']:13.4f} {r['mean_logit_diff']:14.5f} {r['argmax_agree']:13.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_dtype.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out / 'kv_dtype.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
