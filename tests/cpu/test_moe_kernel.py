"""The grouped expert kernel (radixkv/cpu/csrc/moe.c) over a GGUF's blocks as the file stores
them: its decoding equals gguf's dequantization, and native (VNNI and scalar) equals the torch
reference bit for bit for every block type, on random experts and routings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.cpu.moe import BLOCK_TYPES, decode_blocks, has_vnni, native_grouped, native_grouped_f32, row_bytes, torch_block_linear

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native kernels did not build (no C compiler)")

# Offsets of each type's fp16 fields, set to small finite values so random bits make weights.
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}


# The builds a user on another CPU runs, compiled here (tests/cpu/test_decode.py's): no AVX2,
# AVX2 without AVX-512, AVX-512 without VNNI (Skylake): all take the scalar integer loops.
OTHER_BUILDS = [
    pytest.param("x86-64-v2", id="portable"),
    pytest.param("x86-64-v3", id="avx2", marks=pytest.mark.skipif(not cpu_features().avx2, reason="needs avx2 and fma to run that build")),
    pytest.param(
        "skylake-avx512", id="avx512-without-vnni",
        marks=pytest.mark.skipif(not cpu_features().avx512, reason="needs avx512f and avx512bw to run that build"),
    ),
]  # fmt: skip


def random_experts(type_name: str, experts: int, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """[experts, rows, row bytes] of random valid blocks."""
    rng = np.random.default_rng(seed)
    per_row = row_bytes(type_name, in_features)
    size = _BYTES[type_name]
    blocks = rng.integers(0, 256, size=(experts * rows * per_row // size, size), dtype=np.uint8)
    for at in _F16_FIELDS[type_name]:
        values = rng.uniform(0.0005, 0.004, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(experts, rows, per_row)


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_decoded_blocks_are_ggufs_values(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_experts(type_name, 1, 8, 512)[0]
    w, scales, mins = decode_blocks(type_name, raw, 512)
    values = (w.reshape(8, -1, 32) * scales[..., None] + (0 if mins is None else mins[..., None])).reshape(8, 512)
    want = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32)).reshape(8, 512)
    if type_name == "Q6_K":  # d * (sc * q) here, (d * sc) * q in gguf: one rounding apart
        torch.testing.assert_close(values, want, rtol=1e-6, atol=1e-9)
    else:
        assert torch.equal(values, want)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_kquant_reference_is_near_the_float_product(type_name):
    """K-quants take x quantized per 256 (one scale a super-block): the reference stays within
    that rounding of x W^T over the file's dequantized values (measured 0.0085 Q4_K, 0.0079 Q6_K
    of max |y| here)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_experts(type_name, 1, 16, 1024, seed=4)[0]
    w = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float64)).reshape(16, 1024)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(4))
    want = x.double() @ w.T
    got = torch_block_linear(x, type_name, raw, 1024)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def _routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[:, 0] = torch.where(ids[:, 0] == 3, 1, ids[:, 0])  # expert 3 is never picked first (some go unrouted)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    routed, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return routed.tolist(), [0, *torch.cumsum(counts, 0).tolist()], order // top_k


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
@pytest.mark.parametrize("tokens", [1, 7, 40])  # 40: groups of 6 tokens and more decode their rows once
def test_native_equals_torch_bit_for_bit(type_name, tokens):
    experts, rows, in_features = 6, 27, 512  # 3 tiles of 8 rows and a tail of 3
    weights = random_experts(type_name, experts, rows, in_features, seed=tokens)
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(tokens)) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0
    x[-1, 256:] = 0.0  # an all-zero super-block: the K-quants' scale 0
    routed, offsets, x_rows = _routing(tokens, experts, 2, tokens)
    want = torch.empty(len(x_rows), rows)
    for g, e in enumerate(routed):
        part = x_rows[offsets[g] : offsets[g + 1]]
        want[offsets[g] : offsets[g + 1]] = torch_block_linear(x[part], type_name, weights[e], in_features)
    paths = [False, True] if has_vnni() else [False]
    for vnni in paths:
        out = torch.full((len(x_rows), rows + 5), float("nan"))[:, :rows]  # a wider row stride
        native_grouped(type_name, weights, x, routed, offsets, x_rows, out, vnni=vnni)
        assert torch.equal(out, want), (type_name, vnni)


def test_fp32_kernel_close_to_torch():
    torch.manual_seed(0)
    weights = torch.randn(5, 40, 96)
    x = torch.randn(9, 96)
    routed, offsets, x_rows = _routing(9, 5, 2, 0)
    out = torch.empty(len(x_rows), 40)
    native_grouped_f32(weights, x, routed, offsets, x_rows, out)
    want = torch.cat([x[x_rows[offsets[g] : offsets[g + 1]]] @ weights[e].T for g, e in enumerate(routed)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_native_same_bits_at_any_thread_count(type_name):
    """The step's (expert, rows) items split over threads: each output is computed whole by one
    thread, so 1, 2 and 3 threads give the same bits (here with more threads than cores too)."""
    experts, rows, in_features = 5, 40, 768
    weights = random_experts(type_name, experts, rows, in_features, seed=3)
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(3))
    routed, offsets, x_rows = _routing(4, experts, 3, 3)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty(len(x_rows), rows)
            native_grouped(type_name, weights, x, routed, offsets, x_rows, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(cpu_features().machine != "x86_64", reason="the builds are x86-64 ones")
@pytest.mark.parametrize("march", OTHER_BUILDS)
def test_builds_for_other_cpus_give_the_same_bits(monkeypatch, tmp_path, march):
    """The grouped kernel and a decode step's one-token calls, built as a CPU without VNNI (or
    without AVX2) builds them: the scalar integer loops, the same bits as the references."""
    from radixkv.model.moe import MappedExperts, group_by_expert, route

    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in native.COMPILE_FLAGS)
    monkeypatch.setattr(native, "COMPILE_FLAGS", flags)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.load() is not None and str(tmp_path) in native.load()._name
    for type_name in ("Q4_K", "Q6_K", "Q8_0", "Q4_1"):
        weights = random_experts(type_name, 4, 11, 512, seed=5)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
        routed, offsets, x_rows = _routing(3, 4, 2, 5)
        out = torch.empty(len(x_rows), 11)
        native_grouped(type_name, weights, x, routed, offsets, x_rows, out)
        want = torch.cat([torch_block_linear(x[x_rows[offsets[g] : offsets[g + 1]]], type_name, weights[e], 512) for g, e in enumerate(routed)])
        assert torch.equal(out, want), (march, type_name)
    hidden, size, experts = 256, 256, 6
    parts = [("Q4_K", random_experts("Q4_K", experts, size, hidden, 1)), ("Q4_K", random_experts("Q4_K", experts, size, hidden, 2)),
             ("Q6_K", random_experts("Q6_K", experts, hidden, size, 3))]  # fmt: skip
    native_block, torch_block = MappedExperts(parts, hidden, size, "native"), MappedExperts(parts, hidden, size, "torch")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
        weights, ids = route(torch.randn(1, experts, generator=torch.Generator().manual_seed(8)), 3, True, dtype)
        groups = group_by_expert(ids, weights)
        want = torch.zeros_like(x).index_add_(0, groups.tokens, torch_block.grouped(x, groups).to(dtype) * groups.weights[:, None])
        assert torch.equal(native_block.one_token(x, ids, weights), want), (march, dtype)
