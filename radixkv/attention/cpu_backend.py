"""The CPU backend: the native kernels (radixkv.cpu.decode, radixkv.cpu.extend) behind the
attention interface.

Stores KV with one native call, runs decode rows (decode steps, the one-token requests of mixed
steps, and every row of a batch-invariant step) through the paged decode kernel and multi-token
requests through the prefill kernel, both reading KV in place; tensors the kernels cannot take
(shapes, or a (compute dtype, page dtype) pair without a kernel: radixkv.cpu.decode.pages_fit)
run the reference's torch code. Attention with sinks (gpt-oss) takes the same kernels, each head's
sink logit joining its softmax's sum where the kernel merges a request's states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixkv.attention import cascade, torch_backend
from radixkv.attention.base import AttentionBackend, AttentionMetadata, BackendCapabilities, DecodeTables, KVReads, LayerPages
from radixkv.attention.torch_backend import RowByRow, TorchStepState
from radixkv.cpu import decode, extend
from radixkv.cpu.native import load


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The requests the kernel runs in a mixed step: their flat q/out rows and tables."""

    rows: torch.Tensor  # [D] int32
    page_table: torch.Tensor  # [D, max_pages] int32
    seq_lens: torch.Tensor  # [D] int32
    plan: torch.Tensor | None = None  # their cascade groups, None: none


@dataclass(frozen=True, slots=True)
class ExtendRows:
    """The multi-token requests of a mixed step, for the prefill kernel: their tables and rows."""

    page_table: torch.Tensor  # [E, max_pages] int32
    seq_lens: torch.Tensor  # [E] int32
    q_starts: torch.Tensor  # [E] int32, each request's first q/out row
    q_lens: torch.Tensor  # [E] int32


@dataclass(frozen=True, slots=True)
class CPUStepState:
    # The kernel takes this step's caches and heads; every table below was range-checked
    # once, here in prepare, since the C code trusts its indices.
    kernel: bool
    page_table: torch.Tensor  # [B, max_pages] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    decode_rows: DecodeRows | None  # mixed steps with one-token requests
    row_by_row: RowByRow | None  # batch-invariant steps
    reference: TorchStepState | None  # where the kernel cannot take the tensors
    plan: torch.Tensor | None = None  # cascade decode's groups (share_reads), None: no groups
    kv_reads: KVReads | None = None  # decode-only steps through the kernel
    extend_rows: ExtendRows | None = None  # mixed steps whose multi-token requests the prefill kernel runs
    decode_only: DecodeTables | None = None  # decode-only steps through the kernel: the tables, checked
    # The reference's state where the kernel was chosen yet a layer takes the reference (pages
    # no kernel reads under q's dtype): made by the first such layer, kept for the step.
    lazy_reference: list[TorchStepState] = field(default_factory=list)

    def decode_tables(self) -> DecodeTables | None:
        return self.decode_only


class CPUBackend(AttentionBackend[CPUStepState]):
    name = "cpu"
    capabilities = BackendCapabilities(batch_invariant=True, fused_cpu_decode=True, attention_sinks=True)

    def __init__(self, decode_amx: bool = True, share_reads: bool = True, cascade_tiles: bool = True) -> None:
        """share_reads: cascade decode, where requests that share a cached prefix read its pages
        once per step for the whole group (EngineConfig.share_decode_reads); cascade_tiles: the
        group's shared keys as matrix-product tiles (EngineConfig.cascade_tiles)."""
        library = load()
        if library is None:
            raise RuntimeError("the CPU backend needs radixkv's native library, which could not be built here")
        # A process-wide setting of the library (it has one): the last backend built sets it.
        library.radixkv_decode_use_amx(int(decode_amx))
        library.radixkv_cascade_use_tiles(int(cascade_tiles))
        self.share_reads = share_reads
        self.reference = torch_backend.TorchBackend()

    def prepare(self, meta: AttentionMetadata[CPUStepState], k_cache: torch.Tensor, num_q_heads: int) -> CPUStepState:
        kernel = decode.cache_fits(k_cache) and decode.heads_fit(num_q_heads, k_cache)
        page_table = meta.page_table.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        num_tokens = meta.slot_mapping.shape[0]
        # Checked even where the kernel does not decode: the native store may still take k/v.
        decode.check_slots(meta.slot_mapping, k_cache)
        if not kernel:
            reference = self.reference.prepare(meta, k_cache, num_q_heads)
            return CPUStepState(False, page_table, seq_lens, None, None, reference)
        decode_rows = row_by_row = extend_rows = None
        if meta.batch_invariant and not meta.is_decode_only:
            row_by_row = torch_backend.row_by_row_tables(meta)
            decode.check_tables(row_by_row.page_table, row_by_row.seq_lens, None, num_tokens, num_pages, page_size)
            # Each row runs as its own request (its bits never depend on the batch), yet a
            # request's rows share its pages: grouped by chunk band, each whole chunk is scored as
            # tiles for all the rows that see it (cpu/decode.prefill_rows_plan), the same bits.
            plan = decode.prefill_rows_plan(row_by_row.request_of_row, row_by_row.seq_lens) if self.share_reads else None
            return CPUStepState(True, page_table, seq_lens, None, row_by_row, None, plan)
        elif meta.is_decode_only:
            decode.check_tables(page_table, seq_lens, None, num_tokens, num_pages, page_size)
            plan = self._plan(meta, page_table, seq_lens, num_q_heads, k_cache)
            reads = KVReads(sum(meta.seq_lens_list), plan.saved_tokens)
            tables = DecodeTables(meta.slot_mapping.to(torch.int64).contiguous(), page_table, seq_lens, plan.plan)
            return CPUStepState(True, page_table, seq_lens, None, None, None, plan.plan, reads, decode_only=tables)
        else:
            requests = torch.tensor([b for b, q_len in enumerate(meta.q_lens_list) if q_len == 1], dtype=torch.long)
            if len(requests):
                rows, tables, lens = meta.cu_q_lens[requests].to(torch.int32), page_table[requests], seq_lens[requests]
                decode.check_tables(tables, lens, rows, num_tokens, num_pages, page_size)
                # Requests decoding beside a prefill group as in a decode-only step.
                decode_rows = DecodeRows(rows, tables, lens, self._plan(meta, tables, lens, num_q_heads, k_cache).plan)
            extend_rows = self._extend_rows(meta, page_table, seq_lens, num_q_heads, k_cache)
        return CPUStepState(True, page_table, seq_lens, decode_rows, row_by_row, None, extend_rows=extend_rows)

    def _extend_rows(self, meta: AttentionMetadata, page_table: torch.Tensor, seq_lens: torch.Tensor, num_q_heads: int,
                     k_cache: torch.Tensor) -> ExtendRows | None:  # fmt: skip
        """The multi-token requests as the prefill kernel takes them (checked), or None where it
        does not run these shapes here (they then take the torch reference)."""
        head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
        if not extend.fits(k_cache.dtype, head_dim, num_q_heads // num_kv_heads):
            return None
        requests = torch.tensor([b for b, q_len in enumerate(meta.q_lens_list) if q_len > 1], dtype=torch.long)
        tables, lens = page_table[requests], seq_lens[requests]
        q_starts, q_lens = meta.cu_q_lens[requests].to(torch.int32), meta.q_lens[requests].to(torch.int32)
        num_tokens = meta.slot_mapping.shape[0]
        decode.check_tables(tables, lens, q_starts, num_tokens, k_cache.shape[0], k_cache.shape[1])
        extend.check_rows(q_starts, q_lens, lens, num_tokens)
        return ExtendRows(tables, lens, q_starts, q_lens)

    def _plan(self, meta: AttentionMetadata, page_table: torch.Tensor, seq_lens: torch.Tensor, num_q_heads: int,
              k_cache: torch.Tensor) -> cascade.CascadePlan:  # fmt: skip
        """The cascade groups of these decoding requests (checked tables), with the CPU kernel's
        thresholds. In a batch-invariant step a group runs each member as the plain kernel runs it
        alone (decode.batch_invariant_plan): which requests group depends on the batch, what a
        member computes does not."""
        if not self.share_reads:
            return cascade.CascadePlan(None, 0)
        thresholds = decode.cascade_thresholds(num_q_heads, k_cache.shape[2], k_cache.shape[3], k_cache.element_size())
        plan = cascade.plan_cascade(page_table, seq_lens, k_cache.shape[1], **thresholds)
        return decode.batch_invariant_plan(plan, seq_lens.shape[0]) if meta.batch_invariant else plan

    def store_pages(self, k: torch.Tensor, v: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[CPUStepState]) -> None:
        k_cache, v_cache, k_scales, v_scales = pages.k_cache, pages.v_cache, pages.k_scales, pages.v_scales
        # prepare() checked the slots: the native store trusts them.
        if not decode.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales):
            torch_backend.store_by_index_copy(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)

    def extend_pages(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: LayerPages,
                     meta: AttentionMetadata[CPUStepState], scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
        return self._extend(q, pages, meta, scale, window, None)

    def decode_pages(
        self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[CPUStepState], scale: float, window: int | None
    ) -> torch.Tensor:
        return self._decode(q, pages, meta, scale, window, None)

    def sink_pages(self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[CPUStepState], scale: float,
                   window: int | None, sinks: torch.Tensor) -> torch.Tensor:  # fmt: skip
        # The kernels add each head's exp(sink - max) where a request's softmax states merge.
        logits = decode.sink_logits(sinks)
        if meta.is_decode_only:
            return self._decode(q, pages, meta, scale, window, logits)
        return self._extend(q, pages, meta, scale, window, logits)

    def _extend(self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[CPUStepState], scale: float,
                window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        state = meta.state
        k_cache, v_cache, k_scales, v_scales = pages.k_cache, pages.v_cache, pages.k_scales, pages.v_scales
        if not state.kernel or not decode.pages_fit(q.dtype, k_cache):
            return self._reference_attention(q, pages, meta, scale, window, sinks)
        q = _rows_side_by_side(q)
        if meta.batch_invariant:  # each row as its own request: the kernel's rows are independent
            tables = state.row_by_row
            return decode.paged_decode(
                q, k_cache, v_cache, tables.page_table, tables.seq_lens, scale, check=False, plan=_plan_for(state.plan, window),
                k_scales=k_scales, v_scales=v_scales, window=window, sinks=sinks,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype)
        rows = state.decode_rows
        if rows is not None:  # requests decoding beside a prefill: one kernel call for all
            decode.paged_decode(
                q, k_cache, v_cache, rows.page_table, rows.seq_lens, scale, rows=rows.rows, out=out, check=False,
                plan=_plan_for(rows.plan, window), k_scales=k_scales, v_scales=v_scales, window=window, sinks=sinks,
            )  # fmt: skip
        requests = state.extend_rows
        if requests is None or q.dtype != k_cache.dtype:
            torch_backend.extend_requests(
                q, k_cache, v_cache, meta, scale, out, skip_one_token=rows is not None, k_scales=k_scales, v_scales=v_scales,
                window=window, sinks=sinks,
            )  # fmt: skip
        elif len(requests.q_lens):
            extend.paged_extend(
                q, k_cache, v_cache, requests.page_table, requests.seq_lens, requests.q_starts, requests.q_lens, scale, out,
                window, sinks,
            )  # fmt: skip
        return out

    def _decode(self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[CPUStepState], scale: float,
                window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        state = meta.state
        if not state.kernel or not decode.pages_fit(q.dtype, pages.k_cache):
            return self._reference_attention(q, pages, meta, scale, window, sinks)
        # Rows are independent in the kernel, so batch-invariant decode steps take it too.
        return decode.paged_decode(
            _rows_side_by_side(q), pages.k_cache, pages.v_cache, state.page_table, state.seq_lens, scale, check=False,
            plan=_plan_for(state.plan, window), k_scales=pages.k_scales, v_scales=pages.v_scales, window=window, sinks=sinks,
        )  # fmt: skip

    def _reference_attention(self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[CPUStepState], scale: float,
                             window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """The torch reference's attention, for tensors no kernel takes."""
        state = self._reference(meta, pages.k_cache, q.shape[1])
        if sinks is not None:
            return torch_backend.reference_sinks(q, pages, meta, state, scale, window, sinks)
        if meta.is_decode_only:
            return torch_backend.reference_decode(q, pages, meta, state, scale, window)
        return torch_backend.reference_extend(q, pages, meta, state, scale, window)

    def _reference(self, meta: AttentionMetadata[CPUStepState], k_cache: torch.Tensor, num_q_heads: int) -> TorchStepState:
        """The reference's state for this step: prepare's where the kernel was ruled out there,
        else built here once a step (a compute dtype whose pages no kernel reads, known only once
        q is)."""
        state = meta.state
        if state.reference is not None:
            return state.reference
        if not state.lazy_reference:
            state.lazy_reference.append(self.reference.prepare(meta, k_cache, num_q_heads))
        return state.lazy_reference[0]


def _plan_for(plan: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """The step's cascade plan for a layer: none for a window layer, whose requests read only
    their last W keys (a group's shared prefix may lie outside a member's window). The step's
    KVReads still count the full layers' reads."""
    return plan if window is None else None


def _rows_side_by_side(q: torch.Tensor) -> torch.Tensor:
    """q as the kernel reads it: each row's heads side by side, unit inner stride (a strided
    slice of the fused qkv output already is; anything else is copied)."""
    return q if q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] else q.contiguous()
