"""The pure-torch reference backend: the yardstick the CPU and Triton backends are tested against.

Stores by index_copy_ (rounding to the pages' storage dtype; int8 quantized per (token, KV head)
with radixkv.cache.kv_dtype), widens what it reads to q's dtype; extend gathers each request's KV through its page table into PyTorch's
scaled_dot_product_attention (bottom-right causal mask over a cached prefix); decode gathers the
whole batch's pages once into one masked SDPA call. No native code runs here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixkv.attention.base import AttentionBackend, AttentionMetadata, BackendCapabilities, DecodeTables, KVReads, LayerPages
from radixkv.cache.kv_dtype import dequantize, quantize_int8, to_storage


@dataclass(frozen=True, slots=True)
class RowByRow:
    """Batch-invariant steps: each query row as its own one-token request over its own prefix."""

    page_table: torch.Tensor  # [T, max_pages] int32, the page table of each row's request
    seq_lens: torch.Tensor  # [T] int32, position + 1 of each row
    request_of_row: torch.Tensor  # [T] int64, the step's request each row belongs to


@dataclass(frozen=True, slots=True)
class TorchStepState:
    # Decode-only steps: flat page indices [B * P] and an additive mask [B, 1, 1, P * page_size].
    decode_pages: torch.Tensor | None
    decode_bias: torch.Tensor | None
    row_by_row: RowByRow | None  # batch-invariant steps only
    kv_reads: KVReads | None = None  # the reference does not count its reads
    # Decode-only steps: the additive mask of each sliding window the step's layers use, made
    # on the first layer that asks (decode_bias is every key's).
    window_biases: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_bias_for(self, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
        if window is None:
            assert self.decode_bias is not None
            return self.decode_bias
        if window not in self.window_biases:
            self.window_biases[window] = decode_gather_inputs(meta, self.decode_bias.dtype, window)[1]
        return self.window_biases[window]

    def decode_tables(self) -> DecodeTables | None:
        return None  # its decode is torch's: no native step may take its place


def row_by_row_tables(meta: AttentionMetadata) -> RowByRow:
    request_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs, device=meta.q_lens.device), meta.q_lens.long())
    return RowByRow(meta.page_table[request_of_row].to(torch.int32), (meta.positions + 1).to(torch.int32), request_of_row)


class TorchBackend(AttentionBackend[TorchStepState]):
    name = "torch"
    capabilities = BackendCapabilities(batch_invariant=True, attention_sinks=True)

    def prepare(self, meta: AttentionMetadata[TorchStepState], k_cache: torch.Tensor, num_q_heads: int) -> TorchStepState:
        pages = bias = None
        if meta.is_decode_only and not meta.batch_invariant:
            pages, bias = decode_gather_inputs(meta, _mask_dtype(k_cache.dtype))
        return TorchStepState(pages, bias, row_by_row_tables(meta) if meta.batch_invariant else None)

    def store_pages(self, k: torch.Tensor, v: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[TorchStepState]) -> None:
        store_by_index_copy(k, v, pages.k_cache, pages.v_cache, meta.slot_mapping, pages.k_scales, pages.v_scales)

    def extend_pages(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: LayerPages,
                     meta: AttentionMetadata[TorchStepState], scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
        return reference_extend(q, pages, meta, meta.state, scale, window)

    def decode_pages(
        self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[TorchStepState], scale: float, window: int | None
    ) -> torch.Tensor:
        return reference_decode(q, pages, meta, meta.state, scale, window)

    def sink_pages(self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[TorchStepState], scale: float,
                   window: int | None, sinks: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return reference_sinks(q, pages, meta, meta.state, scale, window, sinks)


def reference_sinks(q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata, state: TorchStepState, scale: float,
                    window: int | None, sinks: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Extend or decode attention with a sink logit per query head in each softmax (gpt-oss)."""
    k_cache, v_cache, k_scales, v_scales = pages.k_cache, pages.v_cache, pages.k_scales, pages.v_scales
    if meta.batch_invariant:
        return attend_row_by_row(q, k_cache, v_cache, state.row_by_row, scale, k_scales, v_scales, window, sinks)
    if meta.is_decode_only:
        bias = state.decode_bias_for(meta, window)
        return decode_gathered(q, k_cache, v_cache, meta.num_seqs, state.decode_pages, bias, scale, k_scales, v_scales, sinks)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    extend_requests(q, k_cache, v_cache, meta, scale, out, k_scales=k_scales, v_scales=v_scales, window=window, sinks=sinks)
    return out


def attend_with_sinks(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, mask: torch.Tensor, scale: float,
                      sinks: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Attention [N, Hq, Lq, D] as transformers' gpt-oss eager attention computes it: q.k times
    scale, the mask (bool, True: seen; or additive), each head's sink logit appended, max
    subtracted, softmax, the sink's column dropped. qt [N, Hq, Lq, D]; kt, vt [N, Hkv, Lk, D]."""
    group = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    scores = torch.matmul(qt, kt.transpose(2, 3)) * scale
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(scores.dtype)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(vt.dtype), vt)


def reference_extend(
    q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata, state: TorchStepState, scale: float, window: int | None = None
) -> torch.Tensor:
    """Extend attention over the pages (the step's own KV is stored already)."""
    if meta.batch_invariant:
        return attend_row_by_row(q, pages.k_cache, pages.v_cache, state.row_by_row, scale, pages.k_scales, pages.v_scales, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    extend_requests(
        q, pages.k_cache, pages.v_cache, meta, scale, out, k_scales=pages.k_scales, v_scales=pages.v_scales, window=window
    )
    return out


def reference_decode(
    q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata, state: TorchStepState, scale: float, window: int | None = None
) -> torch.Tensor:
    """Decode attention, one query row per request."""
    k_cache, v_cache, k_scales, v_scales = pages.k_cache, pages.v_cache, pages.k_scales, pages.v_scales
    if meta.batch_invariant:  # padding to the longest request would change the reduction
        return attend_row_by_row(q, k_cache, v_cache, state.row_by_row, scale, k_scales, v_scales, window)
    bias = state.decode_bias_for(meta, window)
    return decode_gathered(q, k_cache, v_cache, meta.num_seqs, state.decode_pages, bias, scale, k_scales, v_scales)


def store_by_index_copy(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """k, v rows into their slots, rounded to the caches' dtype (int8: quantized, the scales
    into k_scales, v_scales); index_copy_ checks the slots' range itself."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for rows, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        if cache.dtype == torch.int8:
            assert scales is not None, "int8 pages need their scale tensor"
            data, row_scales = quantize_int8(rows)
            scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, row_scales)
        else:
            data = to_storage(rows, cache.dtype)
        _as_bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, _as_bytes(data))


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes: index_copy_ and index_select lack fp8 kernels on CPU."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _mask_dtype(storage: torch.dtype) -> torch.dtype:
    """A float dtype for decode's additive mask (cast to q's dtype when used): int8 and fp8
    pages have no -inf."""
    return storage if storage in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def extend_requests(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    skip_one_token: bool = False,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Each request's rows of out: its KV gathered through its page table, one SDPA call per
    request. skip_one_token leaves the rows of one-token requests to a caller that has them."""
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.q_lens_list, meta.seq_lens_list)):
        end = start + q_len
        if q_len > 1 or not skip_one_token:
            keys = _gather(k_cache, meta.page_table[b], seq_len, k_scales, q.dtype)
            values = _gather(v_cache, meta.page_table[b], seq_len, v_scales, q.dtype)
            out[start:end] = _attend(q[start:end], keys, values, seq_len - q_len, scale, window, sinks)
        start = end


def attend_row_by_row(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: RowByRow, scale: float,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each query row attends to the keys up to its own position as if it were decoding, so its
    result cannot depend on the other rows or on how its prefix was computed (the KV of this
    step's tokens is already in the pages). One SDPA call per row."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for row, seq_len in enumerate(tables.seq_lens.tolist()):
        page_row = tables.page_table[row]
        keys = _gather(k_cache, page_row, seq_len, k_scales, q.dtype)
        values = _gather(v_cache, page_row, seq_len, v_scales, q.dtype)
        out[row : row + 1] = _attend(q[row : row + 1], keys, values, seq_len - 1, scale, window, sinks)
    return out


def decode_gather_inputs(
    meta: AttentionMetadata, dtype: torch.dtype, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat page indices [B * P] and an additive mask [B, 1, 1, P * page_size] for decode_gathered
    (with a window, keys before each request's last `window` masked too)."""
    num_pages = -(-meta.max_seq_len // meta.page_size)
    pages = meta.page_table[:, :num_pages].reshape(-1).long()
    key_pos = torch.arange(num_pages * meta.page_size, device=pages.device)
    seq_lens = meta.seq_lens.to(pages.device)[:, None]
    visible = key_pos[None, :] < seq_lens
    if window is not None:
        visible &= key_pos[None, :] >= seq_lens - window
    bias = torch.zeros(visible.shape, dtype=dtype, device=pages.device).masked_fill_(~visible, float("-inf"))
    return pages, bias[:, None, None, :]


def decode_gathered(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: int,
    pages: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One padded gather and one SDPA call for the whole batch: a per-request loop costs a
    kernel launch per request per layer, which dominates short decode steps."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    keys = _gather_pages(k_cache, pages, k_scales, q.dtype).view(batch, -1, num_kv_heads, head_dim)
    values = _gather_pages(v_cache, pages, v_scales, q.dtype).view(batch, -1, num_kv_heads, head_dim)
    if sinks is not None:
        return attend_with_sinks(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), bias, scale, sinks).squeeze(2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=bias.to(q.dtype),
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows of whole pages, [len(pages), page_size * num_kv_heads * head_dim], widened to dtype
    (int8 times its scales); index_select on a 2-D view copies whole pages and runs about 5x
    faster than advanced indexing on CPU."""
    rows = torch.index_select(_as_bytes(cache).view(cache.shape[0], -1), 0, pages).view(cache.dtype)
    if scales is None:
        return rows.to(dtype)
    row_scales = torch.index_select(scales.view(scales.shape[0], -1), 0, pages)
    head_dim = cache.shape[-1]
    return dequantize(rows.view(*row_scales.shape, head_dim), row_scales, dtype).view(rows.shape)


def _gather(cache: torch.Tensor, pages: torch.Tensor, seq_len: int, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The first seq_len tokens of one request's KV, [seq_len, num_kv_heads, head_dim], in dtype."""
    page_size, num_kv_heads, head_dim = cache.shape[1:]
    num_pages = -(-seq_len // page_size)
    return _gather_pages(cache, pages[:num_pages].long(), scales, dtype).view(-1, num_kv_heads, head_dim)[:seq_len]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_len: int, scale: float, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of q_len queries at positions prefix_len.. over kv_len keys, causally (and each
    over its last `window` keys only, where given)."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    # [1, heads, len, head_dim]: with a batch dimension PyTorch's CPU flash kernel runs; 3-D
    # inputs fall back to the math path, several times slower on long prompts.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    if prefix_len == 0 and (window is None or window >= kv_len) and sinks is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(prefix_len, prefix_len + q_len, device=q.device)
        key_pos = torch.arange(kv_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        if sinks is not None:
            return attend_with_sinks(qt, kt, vt, mask[None, None], scale, sinks).squeeze(0).transpose(0, 1)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
