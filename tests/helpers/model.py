"""Helpers for the model tests: tiny random HF models with every weight random (biases and norms
too), attention metadata for requests on contiguous pages, and a stepper that runs a schedule of
prefill chunks and decode tokens through our forward."""

from __future__ import annotations

from pathlib import Path

import torch

from radixkv.attention.base import AttentionMetadata
from radixkv.cache.kv_dtype import SCALE_DTYPE
from radixkv.model.loader import LoadedModel, hf_reference_model
from tests.helpers.tiny_models import save_random_model


def make_random_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny `arch` model whose weights, biases and norm scales are all random, saved to path."""

    def init(name: str, param: torch.nn.Parameter) -> None:
        if "norm" in name:  # around 1, so a wrong eps or missing norm shows
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        elif param.dim() == 1:  # biases are zero at init: make them count
            param.normal_(0.0, 0.2)
        else:
            param.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.15)

    return save_random_model(path, arch, seed, init, **overrides)


def contiguous_metadata(
    prefix_lens: list[int], q_lens: list[int], page_size: int, page_table: torch.Tensor
) -> AttentionMetadata:
    """Metadata for B requests, request b computing q_lens[b] tokens after prefix_lens[b] cached
    ones, its KV in the pages page_table[b] (in order)."""
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens, strict=True)]
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)])
    request = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    pages = page_table.long()[request, positions // page_size]
    cu_q_lens = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_q_lens[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return AttentionMetadata(
        positions=positions,
        slot_mapping=pages * page_size + positions % page_size,
        page_table=page_table.to(torch.int32),
        cu_q_lens=cu_q_lens,
        q_lens=torch.tensor(q_lens, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        page_size=page_size,
        q_lens_list=list(q_lens),
        seq_lens_list=seq_lens,
    )


class Stepper:
    """Runs several requests through our forward step by step over one paged KV cache.

    Each request owns pages_per_seq pages; with shuffle the pages are a random permutation so
    a forward that ignored the page table would read the wrong KV.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        sequences: list[list[int]],
        page_size: int = 4,
        pages_per_seq: int = 16,
        shuffle: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """kv_dtype: the pages' storage dtype (None: the model's); int8 pages get their scales."""
        config = loaded.config
        self.model, self.sequences, self.page_size = loaded.model, sequences, page_size
        num_pages = len(sequences) * pages_per_seq
        order = torch.randperm(num_pages) if shuffle else torch.arange(num_pages)
        self.page_table = order.view(len(sequences), pages_per_seq)
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        kv_dtype = kv_dtype or loaded.dtype
        self.k_caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(config.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(config.num_layers)]
        scales = kv_dtype == torch.int8
        self.k_scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE) for _ in range(config.num_layers)] if scales else None
        self.v_scales = [torch.zeros(shape[:3], dtype=SCALE_DTYPE) for _ in range(config.num_layers)] if scales else None
        self.num_computed = [0] * len(sequences)

    @torch.inference_mode()
    def step(self, new_tokens: dict[int, int], all_logits: bool = True) -> dict[int, torch.Tensor]:
        """Compute new_tokens[r] more tokens of each request r in one flat batch.

        Returns per request the logits [n, vocab] of every new token (all_logits) or [1, vocab]
        of its last one.
        """
        requests = sorted(new_tokens)
        prefix_lens = [self.num_computed[r] for r in requests]
        q_lens = [new_tokens[r] for r in requests]
        meta = contiguous_metadata(prefix_lens, q_lens, self.page_size, self.page_table[requests])
        input_ids = torch.tensor(
            [t for r, p, q in zip(requests, prefix_lens, q_lens) for t in self.sequences[r][p : p + q]]
        )
        ends = meta.cu_q_lens[1:].long()
        if all_logits:
            rows = torch.arange(len(input_ids))
        else:
            rows = ends - 1
        logits = self.model(input_ids, meta.positions, meta, self.k_caches, self.v_caches, rows, self.k_scales, self.v_scales)
        out, start = {}, 0
        for r, q, end in zip(requests, q_lens, ends.tolist()):
            out[r] = logits[end - q : end] if all_logits else logits[start : start + 1]
            start += 1
            self.num_computed[r] += q
        return out


@torch.inference_mode()
def reference_logits(
    folder: Path | str, sequences: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """transformers' logits [len, vocab] (fp32) for each whole sequence, one at a time."""
    hf = hf_reference_model(folder, dtype)  # a GGUF's folder: transformers reads the GGUF
    hf.eval()
    return [hf(torch.tensor([seq])).logits[0].float() for seq in sequences]
