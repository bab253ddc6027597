"""The Triton kernels against the pure-torch reference backend, on CPU under TRITON_INTERPRET=1
(or on a GPU).

Every run draws fresh random inputs (the seed is printed on failure), poisons outputs with NaN
before each launch, and uses logits large enough that softmax is far from uniform.

Tolerances, relative to the magnitude of the reference output (max |ref|), both atol and rtol:
- fp32: 1e-5. The kernel and the reference both compute in fp32 with a different summation
  order (online softmax, tiles, split merge); observed errors are ~1e-6.
- fp16: 2e-3. Inputs are exactly fp16 and the reference is the torch backend run in fp32 on
  those same values; the kernel accumulates in fp32 but rounds the softmax probabilities to
  fp16 before P @ V (as every fp16 flash kernel does, rel. error 2^-11 ~ 4.9e-4 per term) and
  rounds its output to fp16 (another 4.9e-4), so errors of ~1e-3 are expected.
- bf16 (GPU only): 2e-2, for the same reasons with 8 mantissa bits (2^-8 ~ 3.9e-3 per rounding).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import pytest
import torch

from radixkv.attention.base import AttentionMetadata
from radixkv.attention.torch_backend import TorchBackend, store_by_index_copy
from radixkv.attention.triton_backend import TritonBackend
from radixkv.kernels import CascadeGroups, ExtendConfig, extend_attention, paged_decode, store_kv
from radixkv.kernels.paged_decode import MAX_SPLITS, splits_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# Scales q so that scores q.k * scale have std ~ QUERY_GAIN: softmax is peaked, not uniform.
QUERY_GAIN = 3.0
UNWRITTEN = 1000.0


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded generator per test; the seed is in the failure message."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@dataclass
class Case:
    """A batch laid out in a paged cache, with the cache already holding every token's KV."""

    q: torch.Tensor
    k: torch.Tensor  # the step's new tokens
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(
    gen: torch.Generator,
    prefix_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    spare_pages: int = 3,
) -> Case:
    """Random q/k/v, a cache of shuffled pages (non-contiguous tables), prefix KV in place, new KV stored."""
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    pages_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_seq) + 1  # one padding column past the longest request
    page_table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = order[used : used + n].to(torch.int32)
        used += n

    def randn(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * gain).to(dtype)

    # Unwritten cache slots hold a huge value: a kernel that reads a slot it should not gets
    # scores and outputs far off. (Not NaN: the torch reference's masked decode turns NaN in
    # masked slots into NaN outputs, since 0 * NaN = NaN.)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), UNWRITTEN, dtype=dtype)
    v_cache = torch.full_like(k_cache, UNWRITTEN)
    slots_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    positions, slots = [], []
    for b, (p, s) in enumerate(zip(prefix_lens, seq_lens)):
        pos = torch.arange(s)
        slot = page_table[b, pos // page_size].long() * page_size + pos % page_size
        slots_flat[slot[:p]] = randn(p, num_kv_heads, head_dim)
        v_flat[slot[:p]] = randn(p, num_kv_heads, head_dim)
        positions.append(pos[p:])
        slots.append(slot[p:])

    total = sum(q_lens)
    q = randn(total, num_q_heads, head_dim, gain=QUERY_GAIN)
    k = randn(total, num_kv_heads, head_dim)
    v = randn(total, num_kv_heads, head_dim)
    slot_mapping = torch.cat(slots)
    slots_flat[slot_mapping] = k
    v_flat[slot_mapping] = v
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        positions=torch.cat(positions).to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE),
        page_table=page_table.to(DEVICE),
        cu_q_lens=cu.to(DEVICE),
        q_lens=torch.tensor(q_lens, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=DEVICE),
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        page_size=page_size,
        q_lens_list=list(q_lens),
        seq_lens_list=seq_lens,
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return Case(to(q), to(k), to(v), to(k_cache), to(v_cache), meta, head_dim**-0.5)


def prepared(backend, meta: AttentionMetadata, k_cache: torch.Tensor, num_q_heads: int) -> AttentionMetadata:
    """A copy of meta with backend's per-step state (cases share one meta between backends)."""
    return backend.begin_step(replace(meta), k_cache, num_q_heads)


def reference(case: Case, decode: bool) -> torch.Tensor:
    """The torch reference backend in fp32 on the very same (already rounded) inputs."""
    f = lambda t: t.float()  # noqa: E731
    torch_backend = TorchBackend()
    meta = prepared(torch_backend, case.meta, f(case.k_cache), case.q.shape[1])
    if decode:
        return torch_backend.decode(f(case.q), f(case.k_cache), f(case.v_cache), meta, case.scale)
    return torch_backend.extend(
        f(case.q), f(case.k), f(case.v), f(case.k_cache), f(case.v_cache), meta, case.scale
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor, gen: torch.Generator, what: str) -> None:
    tol = TOLERANCE[out.dtype]
    magnitude = ref.abs().max().item()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (seed {gen.initial_seed()})"
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * magnitude, (
        f"{what}: max error {err:.3g} > {tol} x {magnitude:.3g} in {out.dtype} (seed {gen.initial_seed()})"
    )


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


# (prefix_lens, q_lens): each row names the edge it covers.
EXTEND_SHAPES = {
    "no_prefix": ([0, 0], [37, 5]),
    "prefix_not_page_multiple": ([19, 45], [7, 30]),
    "extend_len_1": ([33, 1, 70], [1, 1, 1]),
    "long_next_to_short": ([200, 2, 0, 9], [40, 1, 3, 2]),
    "mixed_chunk_and_decode_rows": ([64, 130, 17], [90, 1, 1]),
}
# (num_q_heads, num_kv_heads): GQA groups 1, 2 and 8.
HEADS = {"group1": (4, 4), "group2": (4, 2), "group8": (8, 1)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("shape", list(EXTEND_SHAPES.values()), ids=list(EXTEND_SHAPES))
def test_extend_matches_torch_backend(gen, shape, heads, page_size, dtype) -> None:
    prefix_lens, q_lens = shape
    case = make_case(gen, prefix_lens, q_lens, *heads, head_dim=32, page_size=page_size, dtype=dtype)
    out = poisoned_like(case.q)
    m = case.meta
    extend_attention(
        case.q, case.k, case.v, case.k_cache, case.v_cache,
        m.cu_q_lens, m.seq_lens, m.page_table, m.max_q_len, case.scale, out=out,
    )
    assert_matches(out, reference(case, decode=False), gen, "extend")


DECODE_SEQ_LENS = {
    "short": [1, 2, 17],
    "long_next_to_short": [250, 3, 1, 64],
    "page_edges": [16, 33, 48],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("seq_lens", list(DECODE_SEQ_LENS.values()), ids=list(DECODE_SEQ_LENS))
def test_decode_matches_torch_backend(gen, seq_lens, heads, page_size, dtype) -> None:
    case = make_case(gen, [s - 1 for s in seq_lens], [1] * len(seq_lens), *heads, head_dim=32,
                     page_size=page_size, dtype=dtype)
    ref = reference(case, decode=True)
    m = case.meta
    for num_splits in (None, 1, 3):  # default (4 on CPU), no split, an odd split count
        out = poisoned_like(case.q)
        paged_decode(case.q, case.k_cache, case.v_cache, m.seq_lens, m.page_table, m.max_seq_len,
                     case.scale, out=out, num_splits=num_splits)
        assert_matches(out, ref, gen, f"decode num_splits={num_splits}")


def share_prefixes(case: Case, groups: list[list[int]], shared_lens: list[int]) -> CascadeGroups:
    """Makes each group's members hold their leader's pages for its first shared_len keys (as the
    radix tree hands out a cached prefix; the reference reads through the same tables) and
    returns the groups as the kernel takes them."""
    m, page_size = case.meta, case.meta.page_size
    own_begin = torch.zeros(len(m.seq_lens_list), dtype=torch.int32)
    for members, shared_len in zip(groups, shared_lens, strict=True):
        assert shared_len % page_size == 0 and all(shared_len <= m.seq_lens_list[b] for b in members)
        for b in members:
            m.page_table[b, : shared_len // page_size] = m.page_table[members[0], : shared_len // page_size]
            own_begin[b] = shared_len
    starts = torch.tensor([0] + [len(g) for g in groups]).cumsum(0).to(torch.int32)
    to = lambda values: torch.as_tensor(values, dtype=torch.int32).to(DEVICE)  # noqa: E731
    return CascadeGroups(to(starts), to([b for g in groups for b in g]), to(shared_lens), to(own_begin),
                         max_shared_len=max(shared_lens), max_members=max(map(len, groups)))


# (seq lens, groups of request indices, shared keys per group): groups of 1 (request 0 alone in
# the first), 2 and 5; a member whose keys are all shared; prefixes on and off split edges.
CASCADE_CASES = {
    "two_groups": ([70, 90, 65, 100, 81, 77, 96, 66], [[1, 2], [3, 4, 5, 6, 7]], [48, 64]),
    "all_shared_member": ([64, 80, 97], [[0, 1, 2]], [64]),
    "one_pair_long": ([300, 290, 20], [[0, 1]], [272]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("layout", list(CASCADE_CASES.values()), ids=list(CASCADE_CASES))
def test_cascade_decode_matches_torch_backend(gen, layout, heads, dtype) -> None:
    seq_lens, groups, shared_lens = layout
    case = make_case(gen, [s - 1 for s in seq_lens], [1] * len(seq_lens), *heads, head_dim=32, page_size=16, dtype=dtype)
    cascade = share_prefixes(case, groups, shared_lens)
    case.meta.page_table = case.meta.page_table.to(DEVICE)
    ref = reference(case, decode=True)
    m = case.meta
    for num_splits in (None, 1):
        out = poisoned_like(case.q)
        paged_decode(case.q, case.k_cache, case.v_cache, m.seq_lens, m.page_table, m.max_seq_len, case.scale,
                     out=out, num_splits=num_splits, groups=cascade)
        assert_matches(out, ref, gen, f"cascade decode num_splits={num_splits}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_other_head_dims_and_tiles(gen, head_dim, dtype) -> None:
    """head_dim 64 and a non-power-of-two 48 (masked dims), with 16-wide tiles at page size 16."""
    case = make_case(gen, [40, 0, 77], [20, 9, 1], 8, 2, head_dim=head_dim, page_size=16, dtype=dtype)
    m = case.meta
    out = poisoned_like(case.q)
    extend_attention(case.q, case.k, case.v, case.k_cache, case.v_cache, m.cu_q_lens, m.seq_lens,
                     m.page_table, m.max_q_len, case.scale, out=out,
                     config=ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1))
    assert_matches(out, reference(case, decode=False), gen, "extend")
    dcase = make_case(gen, [99, 5, 160], [1, 1, 1], 8, 2, head_dim=head_dim, page_size=16, dtype=dtype)
    dm = dcase.meta
    out = poisoned_like(dcase.q)
    paged_decode(dcase.q, dcase.k_cache, dcase.v_cache, dm.seq_lens, dm.page_table, dm.max_seq_len,
                 dcase.scale, out=out)
    assert_matches(out, reference(dcase, decode=True), gen, "decode")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_matches_torch_backend(gen, page_size, dtype) -> None:
    num_tokens, num_kv_heads, head_dim = 20, 2, 32
    num_pages = 40 // page_size + 1  # room for every token, plus slots nobody writes
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # "do not store"
    slots = slots.to(DEVICE)
    # Non-contiguous k/v, as when they are slices of a fused qkv projection.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_by_index_copy(k, v, ref_k, ref_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backend_forward_mixed_batch_then_decode(gen, dtype) -> None:
    """TritonBackend.forward (store + extend, then store + decode) against TorchBackend.forward."""
    prefix_lens, q_lens = [35, 0, 50], [12, 20, 1]
    case = make_case(gen, prefix_lens, q_lens, 8, 2, head_dim=32, page_size=16, dtype=dtype)
    # Blank the step's own slots so the backends must write them.
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, 2, 32)[case.meta.slot_mapping] = UNWRITTEN
    results = []
    for backend in (TorchBackend(), TritonBackend(check_indices=True)):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        meta = prepared(backend, case.meta, k_cache, case.q.shape[1])
        out = backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta, case.scale)
        results.append((out, k_cache, v_cache))
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = results
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert_matches(out, ref.float(), gen, "forward extend")

    dcase = make_case(gen, [40, 3, 129], [1, 1, 1], 8, 2, head_dim=32, page_size=16, dtype=dtype)
    triton = TritonBackend(check_indices=True)
    meta = prepared(triton, dcase.meta, dcase.k_cache, dcase.q.shape[1])
    out = triton.forward(dcase.q, dcase.k, dcase.v, dcase.k_cache, dcase.v_cache, meta, dcase.scale)
    assert_matches(out, reference(dcase, decode=True), gen, "forward decode")


def test_backend_rejects_out_of_range_indices(gen) -> None:
    case = make_case(gen, [20, 5], [4, 1], 4, 2, head_dim=32, page_size=16, dtype=torch.float32)
    backend = TritonBackend(check_indices=True)
    num_pages = case.k_cache.shape[0]
    bad = case.meta.page_table.clone()
    bad[0, 0] = num_pages
    # prepare() checks once per step what every layer's launches then trust.
    with pytest.raises(IndexError, match="page table"):
        backend.prepare(replace(case.meta, page_table=bad), case.k_cache, 4)
    slots = case.meta.slot_mapping.clone()
    slots[0] = num_pages * 16
    with pytest.raises(IndexError, match="slot"):
        backend.prepare(replace(case.meta, slot_mapping=slots), case.k_cache, 4)
    with pytest.raises(IndexError, match="page table"):
        backend.prepare(replace(case.meta, page_table=case.meta.page_table[:, :1]), case.k_cache, 4)


def test_inputs_make_softmax_peaked(gen) -> None:
    """The generated logits are large enough that attention is far from uniform.

    With near-uniform softmax an output is the mean of all values, and a kernel reading the
    wrong keys or dropping a few would still pass.
    """
    case = make_case(gen, [255], [1], 4, 4, head_dim=32, page_size=16, dtype=torch.float32)
    m = case.meta
    slots = m.page_table[0].long().repeat_interleave(16) * 16 + torch.arange(16, device=m.page_table.device).repeat(m.page_table.shape[1])
    keys = case.k_cache.view(-1, 4, 32)[slots[: m.seq_lens_list[0]].to(case.k_cache.device)]
    probs = (torch.einsum("hd,thd->ht", case.q[0].float(), keys.float()) * case.scale).softmax(-1)
    uniform = 1.0 / m.seq_lens_list[0]
    assert probs.max(-1).values.mean() > 20 * uniform, f"seed {gen.initial_seed()}"


def test_split_heuristic() -> None:
    # Small batch, long context on a 132-SM GPU: split, but at most MAX_SPLITS.
    assert splits_for(1, 8, 128_000, 132) == MAX_SPLITS
    assert splits_for(32, 8, 16_384, 132) == 3
    # Enough programs already, or too short to split: one split.
    assert splits_for(256, 8, 16_384, 132) == 1
    assert splits_for(1, 8, 300, 132) == 1
