"""The Triton attention backend: the GPU path, with kernels from radixkv.kernels.

Launches store_kv, extend_attention and paged_decode. Triton does not bounds-check loads, so
index ranges are checked here before launch: always where it costs nothing (Python lengths and
shapes), and on device values (page table, slots, offsets) when check_indices is on, which is
the default under the interpreter or with RADIXKV_CHECK_INDICES=1, since those checks sync.
"""

from __future__ import annotations

import os

import torch

from radixkv.attention.base import AttentionBackend, AttentionMetadata
from radixkv.kernels import extend_attention, paged_decode, store_kv


def _default_check_indices() -> bool:
    flag = os.environ.get("RADIXKV_CHECK_INDICES")
    if flag is not None:
        return flag not in ("", "0")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, check_indices: bool | None = None) -> None:
        self.check_indices = _default_check_indices() if check_indices is None else check_indices

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if k.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
        slot_mapping = slot_mapping.to(device=k.device, dtype=torch.int64)
        if self.check_indices and slot_mapping.numel() > 0:
            num_slots = k_cache.shape[0] * k_cache.shape[1]
            top = int(slot_mapping.max())
            if top >= num_slots:
                raise IndexError(f"slot {top} is out of range: the cache has {num_slots} slots")
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        cu_q_lens, seq_lens, page_table = self._prepare(q, k_cache, meta)
        return extend_attention(
            q, k, v, k_cache, v_cache, cu_q_lens, seq_lens, page_table, meta.max_q_len, scale
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if any(n != 1 for n in meta.q_lens_list):
            raise ValueError("decode needs exactly one new token per request; use extend")
        _, seq_lens, page_table = self._prepare(q, k_cache, meta)
        return paged_decode(q, k_cache, v_cache, seq_lens, page_table, meta.max_seq_len, scale)

    def _prepare(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The metadata tensors on q's device as int32, after the checks that keep loads in range."""
        num_pages, page_size = k_cache.shape[:2]
        if meta.page_size != page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != cache page size {page_size}")
        if sum(meta.q_lens_list) != q.shape[0]:
            raise ValueError(f"q has {q.shape[0]} rows but the requests' q_lens sum to {sum(meta.q_lens_list)}")
        if any(s < n for s, n in zip(meta.seq_lens_list, meta.q_lens_list)):
            raise ValueError("a request has seq_len < q_len")
        longest = max(meta.seq_lens_list, default=0)
        if longest > meta.page_table.shape[1] * page_size:
            raise IndexError(
                f"seq_len {longest} needs more than the page table's {meta.page_table.shape[1]} pages"
            )
        if longest > meta.max_seq_len or max(meta.q_lens_list, default=0) > meta.max_q_len:
            raise ValueError("max_seq_len / max_q_len are smaller than the longest request")
        device = q.device
        cu_q_lens = meta.cu_q_lens.to(device=device, dtype=torch.int32)
        seq_lens = meta.seq_lens.to(device=device, dtype=torch.int32)
        page_table = meta.page_table.to(device=device, dtype=torch.int32)
        if self.check_indices:
            self._check_device_indices(cu_q_lens, seq_lens, page_table, meta, num_pages)
        return cu_q_lens, seq_lens, page_table

    @staticmethod
    def _check_device_indices(
        cu_q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        meta: AttentionMetadata,
        num_pages: int,
    ) -> None:
        """Device values against the host lengths and the cache size (syncs; debug only)."""
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
