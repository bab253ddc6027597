"""Quality of each weight format: perplexity on a fixed text (scenarios/data/, public domain)
through radixkv's own model, in process: weight_dtype "float" in fp32 (the model transformers
computes), "float" in bf16, "auto" (a GGUF's blocks kept, activations quantized to int8 per
block) and "int8" (every linear requantized to 8 bits), each with its difference to the first.

    radixkv bench perplexity [--model PATH] [--text FILE] [--max-tokens N] [--out out/perplexity]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent / "data" / "us_constitution_article_1.txt"
# (label, weight_dtype, dtype): the first is the reference the others are compared with.
FORMATS = (
    ("float fp32", "float", "float32"),
    ("float bf16", "float", "bfloat16"),
    ("auto fp32", "auto", "float32"),
    ("int8 fp32", "int8", "float32"),
)
_CHUNK = 256  # tokens a forward: bounds the logits held at once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--formats", default=None, help="comma-separated labels of FORMATS to run (default all)")
    parser.add_argument("--out", default="out/perplexity")
    args = parser.parse_args(argv)

    chosen = [f for f in FORMATS if args.formats is None or f[0] in args.formats.split(",")]
    rows, reference = [], None
    for label, weight_dtype, dtype in chosen:
        row = score(args.model, Path(args.text).read_text(), weight_dtype, dtype, args.max_tokens)
        row["format"] = label
        if reference is None:
            reference = row
        row["ppl_change_pct"] = round(100 * (row["perplexity"] / reference["perplexity"] - 1), 3)
        rows.append(row)
        print(f"{label}: perplexity {row['perplexity']:.4f} over {row['tokens']} tokens ({row['seconds']:.1f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "text": Path(args.text).name, "machine": platform.processor() or platform.machine(), "rows": rows}
    (out / "perplexity.json").write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(rows))
    return 0


def score(model: str | None, text: str, weight_dtype: str, dtype: str, max_tokens: int | None) -> dict:
    """Perplexity of text under the model loaded with weight_dtype in dtype: exp of the mean
    negative log-likelihood of each token after the first, from one pass over the text."""
    from radixkv.attention import make_backend
    from radixkv.model.loader import load_model

    start = time.perf_counter()
    loaded = load_model(model, make_backend("auto", "cpu"), dtype=dtype, device="cpu", weight_dtype=weight_dtype)
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[: min(len(ids), max_tokens or len(ids), loaded.config.max_position_embeddings)]
    nll = _negative_log_likelihoods(loaded, ids)
    return {
        "weight_dtype": weight_dtype,
        "weight_format": loaded.weight_format,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "tokens": len(ids),
        "mean_nll": round(float(nll.mean()), 6),
        "perplexity": round(math.exp(float(nll.mean())), 4),
        "seconds": round(time.perf_counter() - start, 1),
    }


@torch.inference_mode()
def _negative_log_likelihoods(loaded, ids: list[int]) -> torch.Tensor:
    """-log p(ids[i + 1] | ids[: i + 1]) for every i: one request prefilled in chunks over its
    own KV pages, every row's logits kept (in fp32, as the model returns them)."""
    from radixkv.attention.base import AttentionMetadata

    config, page_size = loaded.config, 16
    num_pages = -(-len(ids) // page_size)
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    k_caches = [torch.zeros(shape, dtype=loaded.dtype) for _ in range(config.num_layers)]
    v_caches = [torch.zeros(shape, dtype=loaded.dtype) for _ in range(config.num_layers)]
    page_table = torch.arange(num_pages, dtype=torch.int32).view(1, num_pages)
    losses = []
    for begin in range(0, len(ids) - 1, _CHUNK):
        end = min(begin + _CHUNK, len(ids) - 1)
        positions = torch.arange(begin, end)
        count = end - begin
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=positions,  # the pages are in order: a token's slot is its position
            page_table=page_table,
            cu_q_lens=torch.tensor([0, count], dtype=torch.int32),
            q_lens=torch.tensor([count], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            prefix_lens=torch.tensor([begin], dtype=torch.int32),
            max_q_len=count,
            max_seq_len=end,
            page_size=page_size,
            q_lens_list=[count],
            seq_lens_list=[end],
        )
        logits = loaded.model(torch.tensor(ids[begin:end]), positions, meta, k_caches, v_caches, torch.arange(count))
        targets = torch.tensor(ids[begin + 1 : end + 1])
        losses.append(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none"))
    return torch.cat(losses)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (the README's)."""
    lines = ["| format | held as | tokens | perplexity | vs float fp32 |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['format']} | {row['weight_format']}, {row['dtype']} | {row['tokens']} | {row['perplexity']:.4f} | {row['ppl_change_pct']:+.3f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
