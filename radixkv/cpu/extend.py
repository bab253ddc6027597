"""Prefill attention on CPU (radixkv/cpu/csrc/paged_extend.c) as a tensor function: each request's
new tokens attend causally to its cached prefix and to one another, the KV read in place.

Checks what the C code trusts (the rows each request owns) and calls the native library; the
page tables are checked as paged decode checks them (radixkv.cpu.decode.check_tables).
"""

from __future__ import annotations

import torch

from radixkv.cpu.native import load

_FUNCTIONS = {torch.bfloat16: "radixkv_paged_extend_bf16", torch.float32: "radixkv_paged_extend_f32"}


def fits(dtype: torch.dtype, head_dim: int, query_heads_per_kv_head: int) -> bool:
    """Whether the kernel runs these shapes on this CPU (AVX-512: fp32 for head_dim % 16 == 0;
    AVX512_BF16: bf16 for head_dim % 32 == 0); where not, callers keep their torch path."""
    library = load()
    return (
        library is not None
        and dtype in _FUNCTIONS
        and bool(library.radixkv_paged_extend_fits(int(dtype == torch.bfloat16), head_dim, query_heads_per_kv_head))
    )


def check_rows(q_starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor, num_q_rows: int) -> None:
    """Each request's new rows lie in q and are among its keys: the C code trusts both."""
    if q_starts.numel() == 0:
        return
    if int(q_starts.min()) < 0 or int((q_starts + q_lens).max()) > num_q_rows:
        raise IndexError(f"a request's new rows fall outside q's {num_q_rows} rows")
    if int(q_lens.min()) < 1 or bool((q_lens > seq_lens).any()):
        raise ValueError("every request needs 1 to seq_len new tokens")


def paged_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Rows q_starts[b] .. q_starts[b] + q_lens[b] of out: request b's new tokens (the last
    q_lens[b] of its seq_lens[b]) over its KV, causally. q and out: [T, num_q_heads, head_dim],
    heads side by side in each row, rows may be strided; int32 contiguous tables, checked by the
    caller (decode.check_tables and check_rows); fits() said yes for these shapes. window: a
    sliding window, the token at position p attending to keys p - window + 1 .. p only. sinks:
    gpt-oss's logit per query head, contiguous fp32 [num_q_heads] (decode.sink_logits), in each
    softmax's sum."""
    library = load()
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    status = getattr(library, _FUNCTIONS[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(),
        page_table.stride(0), seq_lens.data_ptr(), q_starts.data_ptr(), q_lens.data_ptr(), seq_lens.shape[0],
        num_q_heads, num_kv_heads, head_dim, page_size, scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
        window or 0, sinks.data_ptr() if sinks is not None else None,
    )  # fmt: skip
    if status == 2:
        raise MemoryError("prefill attention could not allocate its work buffers")
    if status != 0:
        raise ValueError(f"prefill attention kernel rejected {num_q_heads} query heads over {num_kv_heads} kv heads, head_dim {head_dim}")
