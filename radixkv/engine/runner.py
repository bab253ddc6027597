"""Runs one scheduled batch: builds the attention metadata, runs the forward over the flat
batch of new tokens, guards against non-finite logits and samples the next tokens. `run` never
touches a request's state: what a step did comes back as one `StepResult`; a row that breaks
(NaN logits, a sampler error, a dead grammar) is reported there, never raised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from radixkv.attention.base import AttentionMetadata, KVReads, StepState
from radixkv.cache.layer_groups import LayerGroups, WindowPages
from radixkv.cache.pages import PagePool
from radixkv.cpu.logits import nonfinite_rows
from radixkv.engine.guide import GuideMasks, PendingMasks
from radixkv.engine.request import Batch, SequenceState
from radixkv.engine.request_output import TokenLogprob
from radixkv.engine.sampler import Sampler
from radixkv.errors import InvalidRequest


@dataclass(slots=True)
class StepResult:
    """What one batch's forward and sampling gave, row by row over its sampling sequences."""

    seqs: list[SequenceState]  # the sampling rows, in batch order
    tokens: list[int]  # one per row (a placeholder on a failed row)
    logprobs: list[TokenLogprob | None]  # one per row; empty when no row asks for logprobs
    failed: dict[int, BaseException]  # rows whose request fails alone, with why
    kv_reads: KVReads | None  # decode reads, from backends that count them
    prepare_s: float
    forward_s: float
    sample_s: float  # the guide masks' wait, the NaN guard and sampling


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, pool: PagePool, device: torch.device, sampler: Sampler, batch_invariant: bool = False,
        groups: LayerGroups | None = None, windows: WindowPages | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.pool = pool
        self.device = device
        self.sampler = sampler
        self.page_size = pool.page_size
        self.batch_invariant = batch_invariant
        self.windows = windows
        # Each layer's caches in layer order: a window layer's come from the window pool.
        self.caches: list[list[torch.Tensor]] = [pool.k_cache, pool.v_cache, pool.k_scales, pool.v_scales]
        if windows is not None and groups is not None:
            w = windows.pool
            self.caches = [groups.per_layer(full, window) if full else [] for full, window in zip(
                self.caches, [w.k_cache, w.v_cache, w.k_scales, w.v_scales])]  # fmt: skip

    def run(self, batch: Batch, pending_masks: PendingMasks | None = None) -> StepResult:
        """Prepare, forward, guard and sample one non-empty batch. `pending_masks` (the guided
        rows' grammar masks, filling while the forward runs) is joined even if the forward fails."""
        seqs = [item.seq for item in batch.items if item.samples]
        started_s = time.perf_counter()
        try:
            input_ids, meta, logits_indices = self.prepare(batch)
            prepared_s = time.perf_counter()
            logits = self.forward(input_ids, meta, logits_indices)
            forwarded_s = time.perf_counter()
        finally:
            masks = pending_masks.join() if pending_masks is not None else None
        failed = _dead_grammar_rows(masks, seqs) if masks is not None else {}
        non_finite = _zero_non_finite_rows(logits)
        tokens, logprobs, sample_failed = self.sampler.sample_batch(logits, seqs, masks)
        failed.update(sample_failed)
        for row in non_finite.nonzero().flatten().tolist():
            failed.setdefault(row, FloatingPointError("non-finite logits"))
        return StepResult(
            seqs, tokens, logprobs, failed, _kv_reads(meta),
            prepare_s=prepared_s - started_s, forward_s=forwarded_s - prepared_s, sample_s=time.perf_counter() - forwarded_s,
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [number of sampling items, vocab] in fp32, in batch order."""
        k_caches, v_caches, k_scales, v_scales = self.caches
        return self.model(input_ids, meta.positions, meta, k_caches, v_caches, logits_indices, k_scales or None, v_scales or None)

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
        if self.windows is not None:
            meta.window_meta = self._window_meta(batch, meta, rows, positions, max_pages, device)
        return _to(input_ids, device), meta, _to(np.asarray(logits_indices, dtype=np.int64), device)

    def _window_meta(
        self, batch: Batch, meta: AttentionMetadata, rows: np.ndarray, positions: np.ndarray, max_pages: int, device: torch.device
    ) -> AttentionMetadata:
        """The step's metadata for the window layers: their own page table and slots. A block
        behind the window has no page (-1): any page stands in, as attention masks it."""
        page_size = self.page_size
        table = np.zeros((len(batch.items), max_pages), dtype=np.int32)
        for row, item in enumerate(batch.items):
            pages = item.seq.window_table[:max_pages]
            table[row, : len(pages)] = pages
        np.maximum(table, 0, out=table)
        slots = table[rows, positions // page_size].astype(np.int64) * page_size + positions % page_size
        return replace(meta, page_table=_to(table, device), slot_mapping=_to(slots, device), backend_state=None)


def _dead_grammar_rows(masks: GuideMasks, seqs: list[SequenceState]) -> dict[int, BaseException]:
    return {
        row: InvalidRequest(
            f"the JSON schema allows no token this model can produce after {len(seqs[row].output_token_ids)} "
            "generated tokens (e.g. a pattern only raw control characters would continue)",
            param="response_format",
            code="schema_unsatisfiable",
        )
        for row in masks.take_dead_rows()
    }


def _zero_non_finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Zero the rows with NaN or infinite logits (one bad sequence, e.g. an overflow), so the
    batch still samples and their requests then fail alone; a bool per row, True where zeroed.
    fp32 rows on CPU take one native pass over their bits (radixkv.cpu.logits.nonfinite_rows);
    elsewhere a row sum is finite where its entries are (short of an overflowing sum). On a
    device the fill runs unconditionally and the rows are read back after sampling, whose
    transfer has synced already: no stall."""
    with torch.inference_mode():  # the logits are an inference tensor: update it in place there
        non_finite = nonfinite_rows(logits)
        if non_finite is None:
            non_finite = ~torch.isfinite(logits.sum(dim=-1))
        if logits.device.type != "cpu" or bool(non_finite.any()):
            logits.masked_fill_(non_finite.unsqueeze(-1), 0.0)
    return non_finite


def _kv_reads(meta: AttentionMetadata[StepState]) -> KVReads | None:
    # Backends that count their decode reads (CPU and Triton) leave them on their step state;
    # the forward has run, so the backend's begin_step has set it.
    return meta.state.kv_reads


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
