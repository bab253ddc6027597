"""The Triton attention backend: the GPU path, with kernels from radixkv.kernels.

Launches store_kv, extend_attention and paged_decode. Triton does not bounds-check loads, so
index ranges are checked once per step in prepare(): always where it costs nothing (Python
lengths and shapes), and on device values (page table, slots, offsets) when check_indices is on
(EngineConfig.check_indices; by default only under the interpreter, since those checks sync).
Pages stored in another dtype than the compute dtype (EngineConfig.kv_dtype) are widened on
load by the kernels; int8 pages are quantized by store_kv and read with their scales. fp8 pages
take the torch reference's store and attention (e4m3 kernels are not written: no GPU here to
test them on).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from radixkv.attention import cascade
from radixkv.attention import torch_backend
from radixkv.attention.base import AttentionBackend, AttentionMetadata, BackendCapabilities, DecodeTables, KVReads, LayerPages
from radixkv.kernels import CascadeGroups, extend_attention, paged_decode, store_kv


@dataclass(frozen=True, slots=True)
class TritonStepState:
    """The metadata tensors on the caches' device as the kernels take them (int32), checked."""

    cu_q_lens: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor  # int64
    groups: CascadeGroups | None = None  # decode-only steps with requests sharing a cached prefix
    kv_reads: KVReads | None = None  # decode-only steps
    # The reference's state, for pages the kernels do not read (fp8), built in prepare.
    reference: torch_backend.TorchStepState | None = None

    def decode_tables(self) -> DecodeTables | None:
        return None  # the GPU runs its layers module by module


class TritonBackend(AttentionBackend[TritonStepState]):
    name = "triton"
    capabilities = BackendCapabilities()

    def __init__(self, check_indices: bool | None = None, share_reads: bool = True, native_planner: bool = True) -> None:
        """share_reads: cascade decode for requests sharing a cached prefix
        (EngineConfig.share_decode_reads), planned on the host from the page tables
        (radixkv.attention.cascade); native_planner: by the native library's C planner where it
        builds (EngineConfig.native_kernels), else in Python, to the same groups."""
        # TRITON_INTERPRET stays an environment variable: Triton itself reads it.
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.check_indices = interpreted if check_indices is None else check_indices
        self.share_reads = share_reads
        self.native_planner = native_planner

    def prepare(self, meta: AttentionMetadata[TritonStepState], k_cache: torch.Tensor, num_q_heads: int) -> TritonStepState:
        """The checks that keep loads in range, then the tables on the caches' device."""
        num_pages, page_size = k_cache.shape[:2]
        if meta.page_size != page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != cache page size {page_size}")
        if any(s < n for s, n in zip(meta.seq_lens_list, meta.q_lens_list)):
            raise ValueError("a request has seq_len < q_len")
        longest = max(meta.seq_lens_list, default=0)
        if longest > meta.page_table.shape[1] * page_size:
            raise IndexError(
                f"seq_len {longest} needs more than the page table's {meta.page_table.shape[1]} pages"
            )
        if longest > meta.max_seq_len or max(meta.q_lens_list, default=0) > meta.max_q_len:
            raise ValueError("max_seq_len / max_q_len are smaller than the longest request")
        device = k_cache.device
        state = TritonStepState(
            cu_q_lens=meta.cu_q_lens.to(device=device, dtype=torch.int32),
            seq_lens=meta.seq_lens.to(device=device, dtype=torch.int32),
            page_table=meta.page_table.to(device=device, dtype=torch.int32),
            slot_mapping=meta.slot_mapping.to(device=device, dtype=torch.int64),
        )
        if self.check_indices:
            self._check_device_indices(state, meta, num_pages, num_pages * page_size)
        if meta.is_decode_only:
            cascade = self.share_reads and not meta.batch_invariant
            groups, saved = _cascade_groups(meta, device, self.native_planner) if cascade else (None, 0)
            state = dataclasses.replace(state, groups=groups, kv_reads=KVReads(sum(meta.seq_lens_list), saved))
        if not kernels_read(k_cache):
            state = dataclasses.replace(state, reference=torch_backend.TorchBackend().prepare(meta, k_cache, num_q_heads))
        return state

    def store_pages(self, k: torch.Tensor, v: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[TritonStepState]) -> None:
        slot_mapping = meta.state.slot_mapping
        if k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
        store = store_kv if kernels_read(pages.k_cache) else torch_backend.store_by_index_copy
        store(k, v, pages.k_cache, pages.v_cache, slot_mapping, pages.k_scales, pages.v_scales)

    def extend_pages(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: LayerPages,
                     meta: AttentionMetadata[TritonStepState], scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
        state = meta.state
        _check_rows(q, meta)
        if state.reference is not None:
            return torch_backend.reference_extend(q, pages, meta, state.reference, scale, window)
        return extend_attention(
            q, k, v, pages.k_cache, pages.v_cache, state.cu_q_lens, state.seq_lens, state.page_table, meta.max_q_len, scale,
            k_scales=pages.k_scales, v_scales=pages.v_scales, window=window,
        )  # fmt: skip

    def decode_pages(
        self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[TritonStepState], scale: float, window: int | None
    ) -> torch.Tensor:
        if any(n != 1 for n in meta.q_lens_list):
            raise ValueError("decode needs exactly one new token per request; use extend")
        state = meta.state
        _check_rows(q, meta)
        if state.reference is not None:
            return torch_backend.reference_decode(q, pages, meta, state.reference, scale, window)
        # A window layer decodes without the step's cascade groups: a group's shared prefix may
        # lie outside a member's window (the step's KVReads count the full layers' reads).
        return paged_decode(
            q, pages.k_cache, pages.v_cache, state.seq_lens, state.page_table, meta.max_seq_len, scale,
            groups=state.groups if window is None else None, k_scales=pages.k_scales, v_scales=pages.v_scales, window=window,
        )  # fmt: skip

    @staticmethod
    def _check_device_indices(state: TritonStepState, meta: AttentionMetadata, num_pages: int, num_slots: int) -> None:
        """Device values against the host lengths and the cache size (syncs; debug only)."""
        cu_q_lens, seq_lens, page_table = state.cu_q_lens, state.seq_lens, state.page_table
        if state.slot_mapping.numel() > 0:
            top = int(state.slot_mapping.max())
            if top >= num_slots:
                raise IndexError(f"slot {top} is out of range: the cache has {num_slots} slots")
        seq_host = torch.tensor(meta.seq_lens_list, dtype=torch.int32)
        cu_host = torch.zeros(len(meta.q_lens_list) + 1, dtype=torch.int32)
        cu_host[1:] = torch.tensor(meta.q_lens_list, dtype=torch.int32).cumsum(0)
        if not torch.equal(seq_lens.cpu(), seq_host):
            raise ValueError("seq_lens disagrees with seq_lens_list")
        if not torch.equal(cu_q_lens.cpu(), cu_host):
            raise ValueError("cu_q_lens disagrees with q_lens_list")
        pages_used = (seq_host + meta.page_size - 1) // meta.page_size
        columns = torch.arange(page_table.shape[1])
        used = columns[None, :] < pages_used[:, None]
        entries = page_table.cpu()[used]
        if entries.numel() > 0 and (int(entries.min()) < 0 or int(entries.max()) >= num_pages):
            raise IndexError(
                f"page table entry out of range [0, {num_pages}): min {int(entries.min())}, max {int(entries.max())}"
            )


def _cascade_groups(meta: AttentionMetadata[TritonStepState], device: torch.device, native_planner: bool) -> tuple[CascadeGroups | None, int]:
    """The step's cascade groups (requests sharing whole cached pages), planned on the host's
    tables and moved to the device (None where nobody shares), and the KV tokens they save reading."""
    # Any two requests sharing 64 tokens group (a shared tile is one matrix product on tensor
    # cores). On an H200 (docs/measurements.md, "On a GPU") that read faster for 32/8 heads of
    # 128 over 4-8k shared tokens, but not always for SmolLM2's 9/3 heads of 64, whose shared
    # keys the per-request kernel reads from L2 anyway; too few runs to fit a rule on yet.
    plan = cascade.plan_cascade(
        meta.page_table, meta.seq_lens, meta.page_size, min_shared_tokens=64, min_group_members=2, native_planner=native_planner
    )
    if plan.plan is None:
        return None, 0
    group_start, members, shared_len, own_begin = plan.groups(len(meta.seq_lens_list))
    sizes = group_start[1:] - group_start[:-1]
    groups = CascadeGroups(
        *(t.to(device) for t in (group_start, members, shared_len, own_begin)),
        max_shared_len=int(shared_len.max()),
        max_members=int(sizes.max()),
    )
    return groups, plan.saved_tokens


def kernels_read(k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels store and read pages of this dtype: fp32, bf16, fp16 (widened
    or rounded to and from any compute dtype) and int8 (with scales); fp8 pages do not."""
    return k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def _check_rows(q: torch.Tensor, meta: AttentionMetadata) -> None:
    if sum(meta.q_lens_list) != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but the requests' q_lens sum to {sum(meta.q_lens_list)}")
