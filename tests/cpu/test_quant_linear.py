"""QuantLinear's native kernels (radixkv/cpu/csrc/quant_linear.c) against its torch path, bit for
bit: every kernel keeps torch_quant_linear's order of operations. Each kernel runs where the CPU
has its feature and is skipped, naming the missing one, elsewhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from radixkv.cpu import quant_linear  # noqa: E402
from radixkv.cpu.quant import QuantWeight, dequantize, from_gguf, quantize_q8_0, stack_rows  # noqa: E402
from radixkv.cpu.quant_linear import (  # noqa: E402
    NATIVE_QUANT_KERNELS,
    QuantEmbedding,
    QuantLinear,
    missing_quant_kernel,
    resolve_quant_kernel,
)
from radixkv.errors import ConfigError  # noqa: E402
from tests.cpu.test_quant import random_blocks  # noqa: E402

KERNELS = [pytest.param(name, marks=pytest.mark.skipif(bool(missing_quant_kernel(name)), reason=missing_quant_kernel(name) or "runs")) for name in NATIVE_QUANT_KERNELS]
# Lower case: Q4_K and Q6_K kept as their super-blocks (q4_k, q6_k), as a GGUF loads under "auto".
SOURCES = ("float", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "q4_k", "q6_k")


def weight_of(source: str, out_features: int, in_features: int, seed: int = 0) -> QuantWeight:
    if source == "float":
        return quantize_q8_0(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05)
    raw = random_blocks(source.upper(), out_features, in_features, seed)
    return from_gguf(source.upper(), raw, (out_features, in_features), super_blocks=source.islower())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("rows", [1, 3, 33, 257])
def test_kernel_equals_torch_path(kernel: str, source: str, rows: int) -> None:
    # 45 outputs: not a multiple of the 8 rows a record interleaves.
    weight, bias = weight_of(source, 45, 512), torch.randn(45)
    native, reference = QuantLinear(weight, bias, kernel=kernel), QuantLinear(weight, bias, kernel="torch")
    assert native.kernel == kernel
    x = torch.randn(rows, 512) * torch.logspace(-2, 2, rows).unsqueeze(1)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    for dtype in (torch.float32, torch.bfloat16):
        y = native(x.to(dtype))
        assert y.dtype == dtype and y.shape == (rows, 45)
        assert torch.equal(y, reference(x.to(dtype)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("source", ["float", "Q4_K", "q4_k", "q6_k"])
def test_rows_independent_of_batch(kernel: str, source: str) -> None:
    layer = QuantLinear(weight_of(source, 70, 256), kernel=kernel)
    x = torch.randn(257, 256)
    full = layer(x)
    for start, stop in ((0, 1), (5, 8), (100, 133), (256, 257)):
        assert torch.equal(layer(x[start:stop]), full[start:stop])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("out_features", [1, 15, 17, 33])
@pytest.mark.parametrize("in_features", [32, 96])
def test_odd_shapes_and_extreme_quants(kernel: str, out_features: int, in_features: int) -> None:
    # Outputs that fill neither an 8- nor a 16-row record; q8_0's -128 and 127 and q4_1's 0 and 15,
    # whose u8 forms (|w|, w + 128) sit at the ends of their range.
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    blocks = (out_features, in_features // 32)
    q8 = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    q8[0, :32] = -128
    q8[-1, -32:] = 127
    q4 = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator)
    q4[0, :16] = 0xFF
    weights = [
        QuantWeight("q8_0", out_features, in_features, q8, torch.rand(blocks, generator=generator) * 0.02, None),
        QuantWeight("q4_1", out_features, in_features, q4, torch.rand(blocks, generator=generator) * 0.03, torch.rand(blocks, generator=generator) * -0.2),
    ]
    x = torch.randn(6, in_features, generator=generator)
    x[1] = 0.0
    x[2, :32] = torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0) * 3.0  # every quant at +-127
    bias = torch.randn(out_features, generator=generator)
    for weight in weights:
        native, reference = QuantLinear(weight, bias, kernel=kernel), QuantLinear(weight, bias, kernel="torch")
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(native(x.to(dtype)), reference(x.to(dtype)))
        ids = torch.arange(out_features).flip(0)
        assert torch.equal(native.weight_rows(ids, torch.float32), dequantize(weight, ids))


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_rows_and_no_bias(kernel: str) -> None:
    weight = weight_of("Q4_1", 16, 256)
    wide = torch.randn(5, 320)
    x = wide[:, :256]  # rows 320 apart
    assert torch.equal(QuantLinear(weight, kernel=kernel)(x), QuantLinear(weight, kernel="torch")(x.contiguous()))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("source", ["float", "Q8_0", "Q4_1", "Q4_K", "q4_k", "q6_k"])
def test_tied_embedding_reads_the_packed_weight(kernel: str, source: str) -> None:
    weight = weight_of(source, 37, 256)
    layer = QuantLinear(weight, kernel=kernel)
    ids = torch.tensor([[0, 36, 8], [7, 7, 15]])
    expected = dequantize(weight)[ids]
    assert torch.equal(layer.weight_rows(ids, torch.float32), expected.reshape(-1, 256))
    assert torch.equal(QuantEmbedding(layer, torch.bfloat16)(ids), expected.bfloat16())
    with pytest.raises(IndexError):
        layer.weight_rows(torch.tensor([37]), torch.float32)


@pytest.mark.parametrize("kernel", [*KERNELS, "torch"])
def test_parts_in_their_own_formats(kernel: str) -> None:
    # A Q4_K_M qkv: q and k in Q4_K, v in Q6_K, one linear; each part runs in its own format.
    parts = [weight_of("q4_k", 40, 512, 1), weight_of("q4_k", 8, 512, 2), weight_of("q6_k", 24, 512, 3)]
    bias = torch.randn(72)
    layer = QuantLinear(parts, bias, kernel=kernel)
    assert layer.format == "parts" and layer.out_features == 72
    x = torch.randn(6, 512)
    alone = torch.cat([QuantLinear(part, None, kernel="torch")(x) for part in parts], dim=1)
    assert torch.equal(layer(x), alone + bias)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(layer(x.to(dtype)), QuantLinear(parts, bias, kernel="torch")(x.to(dtype)))
    with pytest.raises(ValueError, match="tied"):
        layer.weight_rows(torch.tensor([0]), torch.float32)
    # Parts of one format are one weight (q4_k as q4_1 where the kernel lacks q4_k: the same bits).
    assert QuantLinear(parts[:2], kernel=kernel).format == ("q4_k" if kernel in ("avx512_vnni_zmm", "torch") else "q4_1")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("source", ["float", "Q8_0", "Q4_1", "q4_k", "q6_k"])
@pytest.mark.parametrize("rows", [(32, 48, 5), (16, 16), (24, 8)])
def test_parts_of_one_format_pack_as_their_rows_stacked(
    kernel: str, source: str, rows: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parts ending on a group boundary pack one by one into the stacked weight's records (no
    # stacked copy at load); a part that does not (24 rows) is stacked first: the same bytes.
    parts = [weight_of(source, n, 512, seed) for seed, n in enumerate(rows)]
    stacks = []
    monkeypatch.setattr(quant_linear, "stack_rows", lambda weights: stacks.append(len(weights)) or stack_rows(weights))
    layer = QuantLinear(parts, kernel=kernel)
    assert stacks == ([] if all(n % 16 == 0 for n in rows[:-1]) else [len(rows)])
    stacked = QuantLinear(stack_rows(parts), kernel=kernel)
    assert layer.format == stacked.format != "parts"
    assert torch.equal(layer.packed, stacked.packed)


@pytest.mark.parametrize("kernel", KERNELS)
def test_super_blocks_packed_near_their_own_bytes(kernel: str) -> None:
    for source, file_bytes in (("q4_k", 144), ("q6_k", 210)):
        layer = QuantLinear(weight_of(source, 64, 512), kernel=kernel)
        ratio = layer.weight_nbytes / (64 * 2 * file_bytes)
        # 512-bit records: 4.625 bits a weight against Q4_K's 4.5 (the scale codes a byte each),
        # Q6_K's own 6.5625; the 256-bit kernels take q4_k as q4_1 (6 bits) and q6_k as int8 (9.5 bits).
        assert ratio <= ((1.03 if source == "q4_k" else 1.0) if kernel == "avx512_vnni_zmm" else 1.45)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("source", "bits"), [("Q8_0", (9, 8.5)), ("Q4_1", (6, 5)), ("Q4_0", (6, 5))])
def test_fp16_scales_stay_fp16_where_the_layout_has_them(kernel: str, source: str, bits: tuple[float, float]) -> None:
    """A GGUF's Q8_0, Q4_1 or Q4_0 (fp16 scales and mins) packs at the file's bits a weight in
    every native layout that has fp16-scaled records (q8_0h, q4_1h); parts of one format whose
    scales differ in dtype pack alike, in fp32: the torch path's bits either way."""
    half, single = weight_of(source, 48, 512, 1), weight_of(source, 16, 512, 2)
    single = QuantWeight(single.format, 16, 512, single.quants, single.scales.float(), None if single.mins is None else single.mins.float())
    assert half.scales.dtype == torch.float16
    halves = kernel in quant_linear._HALF_SCALE_LAYOUTS
    layer = QuantLinear(half, kernel=kernel)
    plain = quant_linear.FORMAT_IDS[half.format]
    assert layer.format == half.format and layer.format_id == (quant_linear.HALF_SCALE_IDS[half.format] if halves else plain)
    assert layer.weight_nbytes == 48 * 512 * bits[halves] / 8
    mixed = QuantLinear([half, single], kernel=kernel)
    assert mixed.format_id == plain and torch.equal(mixed.packed, QuantLinear(stack_rows([half, single]), kernel=kernel).packed)
    x = torch.randn(5, 512)
    x[1, :32] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(mixed(x.to(dtype)), QuantLinear([half, single], kernel="torch")(x.to(dtype)))
        assert torch.equal(layer(x.to(dtype)), QuantLinear(half, kernel="torch")(x.to(dtype)))
    ids = torch.tensor([0, 47, 17])
    assert torch.equal(layer.weight_rows(ids, torch.float32), dequantize(half)[ids])


def test_native_weight_is_held_once_packed() -> None:
    if missing_quant_kernel("avx2"):
        pytest.skip(missing_quant_kernel("avx2"))
    layer = QuantLinear(weight_of("Q4_K", 45, 512), kernel="avx2")
    assert layer.weight is None
    assert layer.weight_nbytes == 6 * 16 * (128 + 64)  # 6 groups of 8 rows, 16 blocks, 192 bytes a record


def test_resolve_quant_kernel() -> None:
    assert resolve_quant_kernel("torch") == "torch"
    assert resolve_quant_kernel("auto", native_kernels=False) == "torch"
    auto = resolve_quant_kernel("auto")
    assert auto == next(iter(quant_linear.available_quant_kernels()), "torch")
    with pytest.raises(ConfigError) as error:
        resolve_quant_kernel("avx9")
    assert error.value.param == "quant_kernel"
    with pytest.raises(ConfigError, match="native_kernels"):
        resolve_quant_kernel("avx2", native_kernels=False)
    for name in NATIVE_QUANT_KERNELS:
        reason = missing_quant_kernel(name)
        if reason:
            with pytest.raises(ConfigError, match="cannot run here") as error:
                resolve_quant_kernel(name)
            assert reason in str(error.value) and error.value.param == "quant_kernel"
        else:
            assert resolve_quant_kernel(name) == name


def test_missing_kernel_names_the_cpu_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.cpu.features import CPUFeatures

    monkeypatch.setattr(quant_linear, "available_quant_kernels", lambda: ())
    monkeypatch.setattr(quant_linear, "cpu_features", lambda: CPUFeatures("x86_64", "old", frozenset({"avx2", "fma"})))
    assert "avx512_vnni" in missing_quant_kernel("avx512_vnni")
    assert missing_quant_kernel("torch") == ""


def test_torch_fallback_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_linear.native, "load", lambda: None)
    assert resolve_quant_kernel("auto") == "torch"
    layer = QuantLinear(weight_of("Q8_0", 9, 64), kernel="auto")
    assert layer.kernel == "torch" and layer.weight is not None
    assert "did not build" in missing_quant_kernel("avx2")


# vpdpbusd for the emulated build below: 8 lanes, each the sum of 4 u8 x s8 products added to src.
_EMULATED_DPBUSD = """
static inline __m256i emulated_dpbusd(__m256i src, __m256i a, __m256i b) {
    uint8_t ua[32]; int8_t sb[32]; int32_t acc[8];
    memcpy(ua, &a, 32); memcpy(sb, &b, 32); memcpy(acc, &src, 32);
    for (int l = 0; l < 8; l++) for (int e = 0; e < 4; e++) acc[l] += (int32_t)ua[4 * l + e] * (int32_t)sb[4 * l + e];
    __m256i r; memcpy(&r, acc, 32); return r;
}
"""


def test_vnni_kernel_logic_under_emulation(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The VNNI kernel's layout and order, on any AVX2 machine: the library built with vpdpbusd
    replaced by a plain C loop and the CPU check forced on (the instruction's own semantics are
    Intel's; what is ours is everything around it)."""
    from radixkv.cpu import native

    if native.load() is None or missing_quant_kernel("avx2"):
        pytest.skip("needs the native AVX2 build")
    for source in native.CSRC.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    path = tmp_path / "quant_linear.c"
    text = path.read_text()
    edits = {
        '#include "kernels.h"\n': '#include "kernels.h"\n' + _EMULATED_DPBUSD,
        "_mm256_dpbusd_epi32(": "emulated_dpbusd(",
        '__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void': "static void",
        'return __builtin_cpu_supports("avx512vnni")': "return 1 || __builtin_cpu_supports(\"avx512vnni\")",
    }
    for old, new in edits.items():
        assert old in text, f"quant_linear.c changed: {old!r} not found"
        text = text.replace(old, new)
    path.write_text(text)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    library = native.build_from(tmp_path, native.find_compiler())
    with native.using(library):
        for source in ("Q8_0", "Q4_K", "q6_k"):
            weight, bias = weight_of(source, 45, 512), torch.randn(45)
            emulated, reference = QuantLinear(weight, bias, kernel="avx512_vnni"), QuantLinear(weight, bias, kernel="torch")
            assert emulated.kernel == "avx512_vnni"
            for rows in (1, 5):
                x = torch.randn(rows, 512)
                assert torch.equal(emulated(x), reference(x))
