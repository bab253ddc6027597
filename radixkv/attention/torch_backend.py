"""The torch attention backend: the CPU path and the reference the Triton kernels are held to.

Extend gathers each request's KV through its page table into PyTorch's
scaled_dot_product_attention (bottom-right causal mask over a cached prefix). Decode rows run
the native paged kernel (radixkv.attention.cpu_decode), which reads KV in place; where it cannot
be built, or off CPU, they gather too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixkv.attention import cpu_decode
from radixkv.attention.base import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._slots_checked: torch.Tensor | None = None  # the last slot mapping found in range

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if slot_mapping is not self._slots_checked and slot_mapping.numel():
            # Checked once per step: every layer stores through the same slot mapping.
            cpu_decode.check_slots(slot_mapping, k_cache)
            self._slots_checked = slot_mapping
        if cpu_decode.store_kv(k, v, k_cache, v_cache, slot_mapping):
            return
        num_kv_heads, head_dim = k_cache.shape[-2:]
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

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
        if meta.batch_invariant:
            return self._extend_row_by_row(q, k_cache, v_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode_rows = self._native_decode_rows(q, k_cache, meta)
        if decode_rows is not None:  # requests decoding beside a prefill: one kernel call for all
            rows, page_table, seq_lens = decode_rows
            check = _first_use(meta, "native_rows_checked")
            cpu_decode.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, rows=rows, out=out, check=check)
        start = 0
        for b, (q_len, seq_len) in enumerate(zip(meta.q_lens_list, meta.seq_lens_list)):
            end = start + q_len
            if q_len > 1 or decode_rows is None:
                keys = _gather(k_cache, meta.page_table[b], seq_len)
                values = _gather(v_cache, meta.page_table[b], seq_len)
                out[start:end] = _attend(q[start:end], keys, values, seq_len - q_len, scale)
            start = end
        return out

    def _extend_row_by_row(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Each query row attends to the keys up to its own position as if it were decoding,
        so its result cannot depend on the other rows or on how its prefix was computed (the
        KV of this step's tokens is already in the pages)."""
        if "row_by_row" not in meta.scratch:
            request_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs), meta.q_lens.long())
            meta.scratch["row_by_row"] = (meta.page_table[request_of_row], (meta.positions + 1).to(torch.int32))
        page_table, seq_lens = meta.scratch["row_by_row"]
        if cpu_decode.supports(q, k_cache):
            return cpu_decode.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, check=_first_use(meta, "row_by_row_checked"))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for row, seq_len in enumerate(seq_lens.tolist()):  # no kernel: one SDPA call per row
            keys, values = _gather(k_cache, page_table[row], seq_len), _gather(v_cache, page_table[row], seq_len)
            out[row : row + 1] = _attend(q[row : row + 1], keys, values, seq_len - 1, scale)
        return out

    @staticmethod
    def _native_decode_rows(
        q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(flat rows, page table, lengths) of the one-token requests, when the native kernel takes them."""
        if "native_rows" not in meta.scratch:
            requests = torch.tensor([b for b, q_len in enumerate(meta.q_lens_list) if q_len == 1], dtype=torch.long)
            usable = len(requests) > 0 and cpu_decode.supports(q, k_cache)
            meta.scratch["native_rows"] = (
                (meta.cu_q_lens[requests], meta.page_table[requests], meta.seq_lens[requests]) if usable else None
            )
        return meta.scratch["native_rows"]

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if "native_ok" not in meta.scratch:  # the same answer for every layer of the step
            meta.scratch["native_ok"] = cpu_decode.supports(q, k_cache)
        if meta.scratch["native_ok"]:
            check = _first_use(meta, "native_checked")
            return cpu_decode.paged_decode(q, k_cache, v_cache, meta.page_table, meta.seq_lens, scale, check=check)
        if meta.batch_invariant:  # padding to the longest request would change the reduction
            return self._extend_row_by_row(q, k_cache, v_cache, meta, scale)
        # One padded gather and one SDPA call for the whole batch: a per-request loop costs
        # a kernel launch per request per layer, which dominates short decode steps.
        pages, bias = self._decode_inputs(meta, q.dtype)
        batch, num_kv_heads, head_dim = meta.num_seqs, k_cache.shape[-2], k_cache.shape[-1]
        keys = _gather_pages(k_cache, pages).view(batch, -1, num_kv_heads, head_dim)
        values = _gather_pages(v_cache, pages).view(batch, -1, num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=bias,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _decode_inputs(meta: AttentionMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat page indices [B * P] and an additive mask [B, 1, 1, P * page_size], once per step."""
        cached = meta.scratch.get("torch_decode")
        if cached is None:
            num_pages = -(-meta.max_seq_len // meta.page_size)
            pages = meta.page_table[:, :num_pages].reshape(-1).long()
            key_pos = torch.arange(num_pages * meta.page_size, device=pages.device)
            visible = key_pos[None, :] < meta.seq_lens.to(pages.device)[:, None]
            bias = torch.zeros(visible.shape, dtype=dtype, device=pages.device).masked_fill_(~visible, float("-inf"))
            cached = meta.scratch["torch_decode"] = (pages, bias[:, None, None, :])
        return cached


def _first_use(meta: AttentionMetadata, key: str) -> bool:
    """True the first time key is asked for in this step: the native kernel's index checks run
    on the first layer only, since every layer reads the same tables through same-shape caches."""
    first = key not in meta.scratch
    meta.scratch[key] = True
    return first


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Rows of whole pages, [len(pages), page_size * num_kv_heads * head_dim]; index_select on
    a 2-D view copies whole pages and runs about 5x faster than advanced indexing on CPU."""
    return torch.index_select(cache.view(cache.shape[0], -1), 0, pages)


def _gather(cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request's KV, [seq_len, num_kv_heads, head_dim]."""
    page_size, num_kv_heads, head_dim = cache.shape[1:]
    num_pages = -(-seq_len // page_size)
    return _gather_pages(cache, pages[:num_pages].long()).view(-1, num_kv_heads, head_dim)[:seq_len]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Attention of q_len queries at positions prefix_len.. over kv_len keys, causally."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    # [1, heads, len, head_dim]: with a batch dimension PyTorch's CPU flash kernel runs; 3-D
    # inputs fall back to the math path, about 8x slower at 512 tokens.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(prefix_len, prefix_len + q_len, device=q.device)
        key_pos = torch.arange(kv_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
