"""Paged KV for the attention kernel tests (tests/cpu/test_decode.py, test_extend.py,
tests/attention/test_cpu_backend.py): requests' KV in a pool of shuffled pages, strided queries,
and the reference they are all held to.

The reference gathers each request's KV through its page table and computes softmax attention
with GQA in float64 on the very same (already rounded) inputs. Every test draws fresh random
inputs (the `gen` fixture, seeded from the test's id, is in failure messages); cache slots no
request owns hold a huge value, so a kernel reading past a request's length or through the
wrong page gives outputs far off; q is a strided slice of a fused qkv tensor, as in the model.

Tolerances (absolute, plus a relative term for the bf16 output rounding):
- fp32: 1e-5 x max(1, sqrt(head_dim / 64)). Both sides compute in (at least) fp32; the
  kernel's fp32 loop sums each q.k sequentially, so its score error grows with head_dim.
- bf16: 2e-2 abs + 1e-2 rel. Inputs are exactly bf16, the kernel accumulates in fp32 and
  rounds its output to bf16 (2^-9 relative).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from radixkv.attention.base import AttentionMetadata

# (atol, rtol); float16 only for the gather fallback (SDPA in fp16).
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}
# Scales q so that scores q.k * scale have std ~ QUERY_GAIN: softmax is peaked, not uniform.
QUERY_GAIN = 3.0
UNWRITTEN = 1000.0


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: each case sees its own data, the same every run,
    so a failure reproduces (the seed is in its message). Hypothesis explores beyond these."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass
class Paged:
    """Requests' KV laid out in a pool of shuffled pages; slots nobody owns hold UNWRITTEN."""

    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    page_size: int


def make_paged(
    gen: torch.Generator,
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    spare_pages: int = 3,
) -> Paged:
    pages_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.zeros(
        len(seq_lens), max(pages_per_seq, default=0) + 1, dtype=torch.int32
    )
    used = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = order[used : used + n]
        used += n
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        owned[slots] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = UNWRITTEN
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Paged(k_cache, v_cache, page_table, lens, page_size)


def make_q(
    gen: torch.Generator,
    rows: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """q [rows, num_q_heads, head_dim] as a strided slice of a fused [rows, q + 2 kv] tensor."""
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=gen) * QUERY_GAIN).to(dtype)
    q = qkv[:, : num_q_heads * head_dim].view(rows, num_q_heads, head_dim)
    assert rows < 2 or not q.is_contiguous()
    return q


def reference(
    q: torch.Tensor, paged: Paged, scale: float, rows: list[int] | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, num_q_heads, head_dim] float64: request b's query row (rows[b], or b) over its KV;
    sinks [num_q_heads]: each head's logit joins its softmax (gpt-oss) and weighs no value."""
    num_q_heads = q.shape[1]
    num_kv_heads, head_dim = paged.k_cache.shape[2:]
    group = num_q_heads // num_kv_heads
    outs = []
    for b, seq_len in enumerate(paged.seq_lens.tolist()):
        pages = paged.page_table[b, : math.ceil(seq_len / paged.page_size)].long()
        keys = (
            paged.k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        )
        values = (
            paged.v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        )
        # Query heads h*group .. h*group+group-1 share kv head h.
        keys, values = (
            keys.repeat_interleave(group, dim=1),
            values.repeat_interleave(group, dim=1),
        )
        query = q[b if rows is None else rows[b]].double()
        scores = torch.einsum("hd,thd->ht", query, keys) * scale
        probs = with_sinks(scores, sinks).softmax(-1)[:, :seq_len]
        outs.append(torch.einsum("ht,thd->hd", probs, values))
    return (
        torch.stack(outs)
        if outs
        else torch.empty(0, num_q_heads, head_dim, dtype=torch.float64)
    )


def with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Scores [heads, keys] with each head's sink logit as one more column (None: as they are)."""
    return scores if sinks is None else torch.cat([scores, sinks.double()[:, None]], dim=-1)


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    atol, rtol = TOLERANCE[dtype]
    if dtype == torch.float32:
        atol *= max(1.0, math.sqrt(out.shape[-1] / 64))
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    torch.testing.assert_close(
        out.double(), ref.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def make_meta(
    paged: Paged, prefix_lens: list[int], q_lens: list[int]
) -> AttentionMetadata:
    """Metadata for B requests, request b computing q_lens[b] tokens after prefix_lens[b] cached ones."""
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    assert seq_lens == paged.seq_lens.tolist()
    positions = torch.cat(
        [torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]
    )
    request = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    pages = paged.page_table.long()[request, positions // paged.page_size]
    cu_q_lens = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_q_lens[1:] = torch.tensor(q_lens).cumsum(0)
    return AttentionMetadata(
        positions=positions,
        slot_mapping=pages * paged.page_size + positions % paged.page_size,
        page_table=paged.page_table,
        cu_q_lens=cu_q_lens,
        q_lens=torch.tensor(q_lens, dtype=torch.int32),
        seq_lens=paged.seq_lens,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        page_size=paged.page_size,
        q_lens_list=list(q_lens),
        seq_lens_list=seq_lens,
    )


def prepared(backend, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int) -> AttentionMetadata:
    """meta with backend's per-step state, as CausalLM.forward sets it at the start of a step."""
    return backend.begin_step(meta, k_cache, num_q_heads)
