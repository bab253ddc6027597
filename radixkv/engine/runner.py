"""Runs one scheduled batch through the model: builds the attention metadata, runs the
forward over the flat batch of new tokens, and returns the logits of the sampling rows.
"""

from __future__ import annotations

import numpy as np
import torch

from radixkv.attention.base import AttentionMetadata
from radixkv.cache.pages import PagePool
from radixkv.engine.request import Batch, SequenceState


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: PagePool, device: torch.device, batch_invariant: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.page_size = pool.page_size
        self.batch_invariant = batch_invariant

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [number of sampling items, vocab] in fp32, in batch order."""
        return self.model(input_ids, meta.positions, meta, self.pool.k_cache, self.pool.v_cache, logits_indices)

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        page_size = self.page_size
        q_lens = [item.num_new_tokens for item in batch.items]
        prefix_lens = [item.seq.num_computed_tokens for item in batch.items]
        seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
        cu_q_lens = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q_lens[1:])
        num_tokens = int(cu_q_lens[-1])

        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        max_pages = max(-(-s // page_size) for s in seq_lens)
        page_table = np.zeros((len(q_lens), max_pages), dtype=np.int32)
        for row, item in enumerate(batch.items):
            seq, start, end = item.seq, prefix_lens[row], seq_lens[row]
            lo, hi = cu_q_lens[row], cu_q_lens[row + 1]
            input_ids[lo:hi] = _token_slice(seq, start, end)
            positions[lo:hi] = np.arange(start, end)
            num_pages = -(-end // page_size)
            page_table[row, :num_pages] = seq.page_table[:num_pages]
        rows = np.repeat(np.arange(len(q_lens)), q_lens)
        slot_mapping = page_table[rows, positions // page_size].astype(np.int64) * page_size + positions % page_size
        logits_indices = [cu_q_lens[i + 1] - 1 for i, item in enumerate(batch.items) if item.samples]

        device = self.device
        meta = AttentionMetadata(
            positions=_to(positions, device),
            slot_mapping=_to(slot_mapping, device),
            page_table=_to(page_table, device),
            cu_q_lens=_to(cu_q_lens.astype(np.int32), device),
            q_lens=_to(np.asarray(q_lens, dtype=np.int32), device),
            seq_lens=_to(np.asarray(seq_lens, dtype=np.int32), device),
            prefix_lens=_to(np.asarray(prefix_lens, dtype=np.int32), device),
            max_q_len=max(q_lens),
            max_seq_len=max(seq_lens),
            page_size=page_size,
            q_lens_list=q_lens,
            seq_lens_list=seq_lens,
            batch_invariant=self.batch_invariant,
        )
        return _to(input_ids, device), meta, _to(np.asarray(logits_indices, dtype=np.int64), device)


def _token_slice(seq: SequenceState, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without building the whole list each step."""
    num_prompt = len(seq.prompt_token_ids)
    if start >= num_prompt:
        return seq.output_token_ids[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return seq.prompt_token_ids[start:end]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[: end - num_prompt]


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)
