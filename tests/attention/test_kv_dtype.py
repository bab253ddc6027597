"""KV pages stored apart from the compute dtype (EngineConfig.kv_dtype): the torch reference with
bf16 and int8 pages against fp32 pages within a bound derived from the stored rounding, and the
CPU backend's kernels against the reference over the same pages."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv.attention.cpu_backend import CPUBackend
from radixkv.attention.torch_backend import TorchBackend, store_by_index_copy
from radixkv.cache.kv_dtype import FP16_MAX, FP16_MIN_NORMAL, SCALE_DTYPE, dequantize, quantize_int8
from radixkv.cache.pages import PagePool
from radixkv.cpu.native import load
from tests.helpers.paged import Paged, assert_close, reference, gen, make_meta, prepared  # noqa: F401 (gen: a fixture)

KV_DTYPES = [torch.bfloat16, torch.int8]
needs_native = pytest.mark.skipif(load() is None, reason="the native library could not be built here")


def _pool(dtype: torch.dtype, num_pages: int, page_size: int, heads: int, head_dim: int) -> PagePool:
    pool = PagePool(num_pages, page_size, 1, heads, head_dim, dtype)
    pool.allocate(num_pages)  # zeroes every page and its scales
    return pool


def _layer(pool: PagePool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    scales = (pool.k_scales[0], pool.v_scales[0]) if pool.k_scales else (None, None)
    return pool.k_cache[0], pool.v_cache[0], *scales


def _case(gen: torch.Generator, prefix_lens: list[int], q_lens: list[int], page_size: int, heads: int, group: int, head_dim: int):
    """Requests' metadata over shuffled pages, every token's K and V (fp32), and q."""
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    pages_per_seq = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages_per_seq) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used : used + n]
        used += n
    layout = Paged(None, None, table, torch.tensor(seq_lens, dtype=torch.int32), page_size)  # what make_meta reads
    all_tokens = make_meta(layout, [0] * len(seq_lens), seq_lens)  # every token, to fill the pages
    step = make_meta(layout, prefix_lens, q_lens)
    tokens = all_tokens.slot_mapping.shape[0]
    # Keys with an offset per head and a spread of row magnitudes, as real K has.
    k = torch.randn(tokens, heads, head_dim, generator=gen) * torch.rand(tokens, heads, 1, generator=gen) * 3 + 0.5
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    q = torch.randn(sum(q_lens), heads * group, head_dim, generator=gen)
    return all_tokens, step, k, v, q, num_pages


def _filled(dtype, all_tokens, k, v, num_pages, page_size):
    pool = _pool(dtype, num_pages, page_size, k.shape[1], k.shape[2])
    k_cache, v_cache, k_scales, v_scales = _layer(pool)
    backend = TorchBackend()
    backend.store_kv(k, v, k_cache, v_cache, prepared(backend, all_tokens, k_cache, 1), k_scales, v_scales)
    return pool


def _run(backend, pool, step, q, scale):
    k_cache, v_cache, k_scales, v_scales = _layer(pool)
    meta = prepared(backend, step, k_cache, q.shape[1])
    if meta.is_decode_only:
        return backend.decode(q, k_cache, v_cache, meta, scale, k_scales, v_scales)
    return backend.extend(q, None, None, k_cache, v_cache, meta, scale, k_scales, v_scales)


def _bound(pool: PagePool, exact: PagePool, step, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Per request, the most its output may move when K and V are perturbed by the pages' rounding:
    scores move by at most d = scale * |q|_1 * max|dk| (as the head's rows do), which moves
    the softmax weights by at most e^(2d) - 1 in l1 (each weight's ratio lies in [e^-2d, e^2d]),
    so |do| <= (e^(2d) - 1) * max|v'| + max|dv|; plus fp32 slack."""
    k_cache, v_cache, k_scales, v_scales = _layer(pool)
    k_wide, v_wide = dequantize(k_cache, k_scales, torch.float32), dequantize(v_cache, v_scales, torch.float32)
    dk = (k_wide - exact.k_cache[0]).abs().amax()
    dv = (v_wide - exact.v_cache[0]).abs().amax()
    d = scale * q.abs().sum(-1).amax() * dk
    return (torch.exp(2 * d) - 1) * v_wide.abs().amax() + dv + 1e-5


CASES = [([0, 0], [7, 19]), ([13, 40], [1, 1]), ([5, 0, 33], [1, 9, 4])]


# fp8 e4m3 too: the engine stores it on e4m3 GPUs only, where the reference serves it.
@pytest.mark.parametrize("dtype", [*KV_DTYPES, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("prefix_lens,q_lens", CASES)
def test_reference_over_narrow_pages_stays_within_the_rounding_bound(gen, dtype, prefix_lens, q_lens):
    page_size, heads, group, head_dim = 4, 2, 3, 32
    all_tokens, step, k, v, q, num_pages = _case(gen, prefix_lens, q_lens, page_size, heads, group, head_dim)
    scale = head_dim**-0.5
    exact = _filled(torch.float32, all_tokens, k, v, num_pages, page_size)
    narrow = _filled(dtype, all_tokens, k, v, num_pages, page_size)
    assert narrow.k_cache[0].dtype == dtype
    want = _run(TorchBackend(), exact, step, q, scale)
    got = _run(TorchBackend(), narrow, step, q, scale)
    assert got.dtype == torch.float32
    bound = _bound(narrow, exact, step, q, scale)
    error = (got - want).abs().amax()
    assert error <= bound, f"{dtype} pages moved the output by {float(error)}, past the bound {float(bound)}"
    assert error > 0  # the pages did round: the test compares two different things


def test_int8_quantization_is_symmetric_per_token_and_head(gen):
    x = torch.randn(5, 3, 16, generator=gen) * 4
    x[2, 1] = 0.0
    data, scales = quantize_int8(x)
    assert data.dtype == torch.int8 and scales.shape == (5, 3) and scales.dtype == SCALE_DTYPE == torch.float16
    # The scale is absmax / 127 rounded to fp16, and the row is quantized with the rounded one.
    assert torch.equal(scales, (x.abs().amax(-1) / 127).to(torch.float16))
    assert torch.equal(data, (x / scales.float()[..., None]).nan_to_num().round().clamp(-127, 127).to(torch.int8))
    assert int(data.abs().max()) == 127 and scales[2, 1] == 0 and not data[2, 1].any()
    # Each element within half a step (the rounded scale's) of its row.
    assert ((dequantize(data, scales, torch.float32) - x).abs() <= scales.float()[..., None] / 2 + 1e-6).all()


def test_int8_scales_stay_in_fp16s_normal_range(gen):
    """A row whose absmax / 127 passes fp16's largest value clamps its scale there (never inf)
    and saturates at +-127; one whose scale would be subnormal clamps it to fp16's smallest
    normal, so its steps stay 2^-14 (at most 2^-15 off each element)."""
    x = torch.randn(4, 2, 64, generator=gen)
    x[0, 0] *= 1e9  # absmax / 127 far past 65504
    x[0, 1] = torch.full((64,), 3e38)  # near fp32's largest
    x[1, 0] *= 1e-4  # absmax / 127 subnormal in fp16
    x[1, 1] *= 1e-12  # absmax / 127 below fp16's smallest subnormal: would flush to 0
    data, scales = quantize_int8(x)
    assert torch.isfinite(scales).all() and (scales.float() > 0).all()
    assert scales[0, 0] == scales[0, 1] == FP16_MAX and scales[1, 0] == scales[1, 1] == FP16_MIN_NORMAL
    assert (data[0].abs() <= 127).all() and (data[0, 1] == 127).all()  # saturated, not wrapped
    assert (data[1, 0] != 0).any()  # the tiny row still carries its signs and shape
    error = (dequantize(data[1], scales[1], torch.float32) - x[1]).abs()
    assert (error <= FP16_MIN_NORMAL / 2).all()
    # The ordinary rows beside them are untouched by the clamps.
    assert torch.equal(scales[2:], (x[2:].abs().amax(-1) / 127).to(torch.float16))


@needs_native
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("prefix_lens,q_lens", CASES)
# (3, 3, 64): the default model's own instance; head_dim 12: the portable item (8 lanes: 24); 6
# and 9 kv heads: int8 scales picked from a block's four parts, and one by one (16 lanes).
@pytest.mark.parametrize("heads,group,head_dim", [(2, 3, 32), (3, 3, 64), (1, 5, 16), (2, 2, 12), (2, 1, 24), (6, 2, 16), (9, 1, 16)])
@pytest.mark.parametrize("page_size", [4, 16])  # 16: full blocks of 16 keys
def test_cpu_backend_matches_the_reference_over_the_same_pages(gen, dtype, prefix_lens, q_lens, heads, group, head_dim, page_size):
    all_tokens, step, k, v, q, num_pages = _case(gen, prefix_lens, q_lens, page_size, heads, group, head_dim)
    pool = _filled(dtype, all_tokens, k, v, num_pages, page_size)
    scale = head_dim**-0.5
    want = _run(TorchBackend(), pool, step, q, scale)
    got = _run(CPUBackend(), pool, step, q, scale)
    assert_close(got, want, torch.float32, f"cpu backend over {dtype} pages")


@needs_native
@pytest.mark.parametrize("prefix_lens,q_lens", CASES)
@pytest.mark.parametrize("heads,group,head_dim", [(2, 3, 32), (1, 5, 12)])  # head_dim 12: the portable item
def test_bf16_compute_over_int8_pages_matches_the_reference(gen, prefix_lens, q_lens, heads, group, head_dim):
    """bf16 compute reads int8 pages through radixkv_paged_decode_bf16_kv, within bf16's
    tolerance of the reference (which widens the pages to bf16 before its SDPA)."""
    from radixkv.cpu import decode

    page_size = 4
    all_tokens, step, k, v, q, num_pages = _case(gen, prefix_lens, q_lens, page_size, heads, group, head_dim)
    pool = _filled(torch.int8, all_tokens, k, v, num_pages, page_size)
    assert decode.pages_fit(torch.bfloat16, pool.k_cache[0])
    q = q.to(torch.bfloat16)
    scale = head_dim**-0.5
    want = _run(TorchBackend(), pool, step, q, scale)
    got = _run(CPUBackend(), pool, step, q, scale)
    assert got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16, "cpu backend, bf16 compute over int8 pages")


@needs_native
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_native_store_writes_the_references_bytes(gen, dtype):
    page_size, heads, group, head_dim = 4, 3, 1, 64
    all_tokens, _, k, v, _, num_pages = _case(gen, [0, 0], [9, 14], page_size, heads, group, head_dim)
    k[3, 1] = 0.0  # a zero row: scale 0
    k[4, 0] *= 1e7  # a huge row: the scale clamps at fp16's largest
    k[5, 2] *= 1e-6  # a tiny row: the scale clamps at fp16's smallest normal
    want = _filled(dtype, all_tokens, k, v, num_pages, page_size)
    got = _pool(dtype, num_pages, page_size, heads, head_dim)
    k_cache, v_cache, k_scales, v_scales = _layer(got)
    backend = CPUBackend()
    backend.store_kv(k, v, k_cache, v_cache, prepared(backend, all_tokens, k_cache, heads), k_scales, v_scales)
    for mine, theirs in zip(got._tensors(), want._tensors()):
        assert torch.equal(mine, theirs)


@needs_native
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 24, 12])  # vector shared items (64, 24: 8 lanes), member by member (12)
def test_cascade_groups_over_narrow_pages_match_the_reference(gen, dtype, head_dim):
    """Requests sharing a long cached prefix decode as a cascade group over bf16 or int8 pages
    (each shared chunk widened once) and give the reference's output."""
    from radixkv.attention import cascade
    from radixkv.cpu import decode

    page_size, heads, group, members = 16, 2, 4, 5
    shared = 300  # over two of the kernel's chunks
    own = [5, 17, 1, 30, 9]
    num_pages = (shared + page_size - 1) // page_size + sum((n + page_size) // page_size + 1 for n in own) + 2
    pool = _pool(dtype, num_pages, page_size, heads, head_dim)
    k_cache, v_cache, k_scales, v_scales = _layer(pool)
    num_slots = num_pages * page_size
    keys = torch.randn(num_slots, heads, head_dim, generator=gen) * 2
    values = torch.randn(num_slots, heads, head_dim, generator=gen)
    store_by_index_copy(keys, values, k_cache, v_cache, torch.arange(num_slots), k_scales, v_scales)
    shared_pages = list(range(shared // page_size))
    next_page = len(shared_pages)
    tables, lens = [], []
    for n in own:
        total = len(shared_pages) * page_size + n
        count = -(-total // page_size)
        tables.append(shared_pages + list(range(next_page, next_page + count - len(shared_pages))))
        next_page += count - len(shared_pages)
        lens.append(total)
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    assert int(page_table.max()) < num_pages
    q = torch.randn(members, heads * group, head_dim, generator=gen)
    plan = cascade.plan_cascade(page_table, seq_lens, page_size, min_shared_tokens=page_size, min_group_members=2)
    assert plan.plan is not None and plan.saved_tokens > 0
    scale = head_dim**-0.5
    grouped = decode.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, plan=plan.plan, k_scales=k_scales, v_scales=v_scales)
    alone = decode.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, k_scales=k_scales, v_scales=v_scales)
    layout = Paged(dequantize(k_cache, k_scales, torch.float32), dequantize(v_cache, v_scales, torch.float32), page_table, seq_lens, page_size)
    want = reference(q, layout, scale)
    assert_close(grouped, want, torch.float32, f"cascade over {dtype} pages")
    assert_close(alone, want, torch.float32, f"plain decode over {dtype} pages")
    # Batch-invariant groups (cut to the 256-key chunk grid, each member through the plain item):
    # every member's bits are its ungrouped output's, under fp32 compute and (int8 pages) bf16.
    exact = decode.batch_invariant_plan(plan, members)
    assert exact.saved_tokens == (members - 1) * 256
    pages = dict(k_scales=k_scales, v_scales=v_scales)
    assert torch.equal(decode.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, plan=exact.plan, **pages), alone)
    if dtype == torch.int8:
        q16 = q.to(torch.bfloat16)
        assert torch.equal(
            decode.paged_decode(q16, k_cache, v_cache, page_table, seq_lens, scale, plan=exact.plan, **pages),
            decode.paged_decode(q16, k_cache, v_cache, page_table, seq_lens, scale, **pages),
        )


@needs_native
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prefix_lens,q_lens", CASES)
def test_sinks_over_narrow_pages_match_the_reference(gen, dtype, compute, prefix_lens, q_lens):
    """gpt-oss's sink logits through the kernels that widen bf16 and int8 pages (fp32 compute) or
    int8 pages (bf16 compute): the reference's output over the same pages."""
    from radixkv.attention.base import LayerPages
    from radixkv.cpu import decode

    page_size, heads, group, head_dim = 4, 2, 3, 32
    all_tokens, step, k, v, q, num_pages = _case(gen, prefix_lens, q_lens, page_size, heads, group, head_dim)
    pool = _filled(dtype, all_tokens, k, v, num_pages, page_size)
    if not decode.pages_fit(compute, pool.k_cache[0]):
        pytest.skip(f"no kernel reads {dtype} pages under {compute} compute")
    q, sinks, scale = q.to(compute), torch.randn(heads * group, generator=gen) * 2, head_dim**-0.5
    outs = []
    for backend in (TorchBackend(), CPUBackend()):
        meta = prepared(backend, step, pool.k_cache[0], q.shape[1])
        outs.append(backend.sink_pages(q, LayerPages(*_layer(pool)), meta, scale, None, sinks))
    assert_close(outs[1], outs[0].double(), compute, f"cpu backend with sinks over {dtype} pages")
