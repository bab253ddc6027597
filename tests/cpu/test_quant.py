"""radixkv.cpu.quant: GGUF blocks into the kernels' two formats (exact, or requantized within a
stated bound), q8_0 quantization of float weights, and QuantLinear's torch path (the reference
the native kernels match) against a float product within the activation-quantization bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from radixkv.cpu.quant import (  # noqa: E402
    EXACT_TYPES,
    REQUANTIZED_TYPES,
    QuantWeight,
    dequantize,
    from_gguf,
    pack_q4,
    quantize_q8_0,
    unpack_q4,
)
from radixkv.cpu.quant_linear import QuantEmbedding, QuantLinear, quantize_activations, torch_quant_linear  # noqa: E402

# Byte offsets of each type's fp16 fields within a block: random bytes there could be NaN or
# inf, which no quantizer writes, so the tests put finite values there.
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Random valid blocks of a type: every quant and scale-code bit pattern, finite fp16 fields."""
    block_size, block_bytes = GGML_QUANT_SIZES[getattr(GGMLQuantizationType, type_name)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_features, in_features // block_size, block_bytes), dtype=np.uint8)
    for start in _F16_FIELDS[type_name]:
        values = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[..., start : start + 2] = values[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)


def reference(type_name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(raw, getattr(GGMLQuantizationType, type_name)).astype(np.float32))


@pytest.mark.parametrize("type_name", EXACT_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_types_dequantize_as_gguf_does(type_name: str, seed: int) -> None:
    raw = random_blocks(type_name, 5, 512, seed)
    weight = from_gguf(type_name, raw, (5, 512))
    assert weight.format == ("q8_0" if type_name in ("Q8_0", "Q5_0") else "q4_1")
    assert torch.equal(dequantize(weight), reference(type_name, raw).reshape(5, 512))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gguf_quantizer_output_converts_exactly(type_name: str) -> None:
    values = np.random.default_rng(3).standard_normal((7, 96)).astype(np.float32)
    raw = gguf_quants.quantize(values, getattr(GGMLQuantizationType, type_name))
    weight = from_gguf(type_name, raw, (7, 96))
    assert torch.equal(dequantize(weight), reference(type_name, raw))


def test_fp16_scales_stay_fp16_where_exact() -> None:
    weight = from_gguf("Q4_1", random_blocks("Q4_1", 3, 64, 0), (3, 64))
    assert weight.scales.dtype == torch.float16 and weight.mins.dtype == torch.float16
    assert weight.nbytes == 3 * 32 + 2 * (3 * 2 * 2)  # nibbles, then fp16 scales and mins: GGUF's own 5 bits a weight


@pytest.mark.parametrize("type_name", REQUANTIZED_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_requantized_types_within_half_an_int8_step(type_name: str, seed: int) -> None:
    raw = random_blocks(type_name, 4, 512, seed)
    weight = from_gguf(type_name, raw, (4, 512))
    assert weight.format == "q8_0"
    expected = reference(type_name, raw).reshape(4, 16, 32)
    error = (dequantize(weight).reshape(4, 16, 32) - expected).abs().amax(dim=-1)
    step = expected.abs().amax(dim=-1) / 127
    assert bool((error <= 0.5 * step * (1 + 2**-10)).all()), float((error / step).max())


def test_unsupported_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="Q2_K.*Q8_0"):
        from_gguf("Q2_K", np.zeros(84, dtype=np.uint8), (1, 256))


def test_nibble_order_low_is_first_half_of_block() -> None:
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = pack_q4(q)
    assert int(packed[0, 0]) == (0 | (0 << 4)) and int(packed[0, 1]) == (1 | (1 << 4))  # q[1], q[17]
    q = torch.randint(0, 16, (3, 96), dtype=torch.uint8)
    assert torch.equal(unpack_q4(pack_q4(q)), q)
    assert int(pack_q4(q)[1, 20]) == int(q[1, 36]) | (int(q[1, 52]) << 4)


def test_rows_selects_and_permutes() -> None:
    weight = from_gguf("Q4_K", random_blocks("Q4_K", 6, 256, 0), (6, 256))
    index = torch.tensor([5, 0, 3])
    assert torch.equal(dequantize(weight.rows(index)), dequantize(weight)[index])
    assert torch.equal(dequantize(weight, index), dequantize(weight)[index])
    assert weight.rows(index).out_features == 3


def test_quantize_q8_0_error_bound() -> None:
    weight = torch.randn(33, 160) * torch.logspace(-3, 1, 33).unsqueeze(1)
    quant = quantize_q8_0(weight)
    assert quant.quants.dtype == torch.int8 and int(quant.quants.abs().max()) <= 127
    error = (dequantize(quant) - weight).abs().reshape(33, 5, 32).amax(dim=-1)
    assert bool((error <= 0.5 * quant.scales * (1 + 1e-6)).all())
    assert torch.equal(dequantize(quantize_q8_0(torch.zeros(2, 32))), torch.zeros(2, 32))


def test_activation_quantization_rounds_half_to_even() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 1.5  # scale 1: 0.5 -> 0, 1.5 -> 2
    q, scales = quantize_activations(x)
    assert float(scales[0, 0]) == 1.0 and q[0, :3].tolist() == [127.0, 0.0, 2.0]


def activation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """|x W^T - Q(x) W^T| per output: each x element moves at most half its block's step
    (absmax / 127 / 2), times |w|; plus fp32 rounding of sums of |x||w|."""
    m, k = x.shape
    step = x.reshape(m, -1, 32).abs().amax(dim=-1) / 127  # [m, nb]
    per_block = weight.abs().reshape(weight.shape[0], -1, 32).sum(dim=-1)  # [out, nb]
    return 0.5 * step @ per_block.T * (1 + 1e-5) + 1e-5 * (x.abs() @ weight.abs().T)


@pytest.mark.parametrize("source", ["Q8_0", "Q4_K", "float"])
def test_torch_path_within_activation_bound(source: str) -> None:
    torch.manual_seed(0)
    if source == "float":
        quant = quantize_q8_0(torch.randn(40, 256) * 0.05)
    else:
        quant = from_gguf(source, random_blocks(source, 40, 256, 0), (40, 256))
    bias = torch.randn(40)
    x = torch.randn(9, 256)
    x[3] = 0.0  # an all-zero row: scale 0, no division
    layer = QuantLinear(quant, bias, kernel="torch")
    w = dequantize(quant)
    expected = x @ w.T + bias
    y = layer(x)
    assert (y - expected).abs().le(activation_bound(x, w)).all()
    assert torch.equal(y[3], torch.zeros(40) + bias)
    # bf16 in, bf16 out: the fp32 result rounded once.
    assert torch.equal(layer(x.bfloat16()), torch_quant_linear(x.bfloat16().float(), quant, bias).bfloat16())


def test_torch_path_rows_independent_of_batch() -> None:
    quant = from_gguf("Q4_0", random_blocks("Q4_0", 24, 128, 1), (24, 128))
    layer = QuantLinear(quant, kernel="torch")
    x = torch.randn(300, 128)  # past one torch-path chunk of rows
    full = layer(x)
    for r in (0, 7, 299):
        assert torch.equal(layer(x[r : r + 1]), full[r : r + 1])


def test_embedding_from_weight_and_tied_linear() -> None:
    quant = from_gguf("Q8_0", random_blocks("Q8_0", 50, 64, 2), (50, 64))
    ids = torch.tensor([[3, 49], [0, 3]])
    expected = dequantize(quant)[ids].bfloat16()
    assert torch.equal(QuantEmbedding(quant, torch.bfloat16)(ids), expected)
    tied = QuantEmbedding(QuantLinear(quant, kernel="torch"), torch.bfloat16)
    assert torch.equal(tied(ids), expected) and tied.weight_nbytes == 0


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_super_blocks_kept_dequantize_as_gguf_does(type_name: str) -> None:
    raw = random_blocks(type_name, 6, 512, 3)
    kept = from_gguf(type_name, raw, (6, 512), super_blocks=True)
    assert kept.format == type_name.lower() and kept.nbytes == raw.size
    assert torch.equal(dequantize(kept), reference(type_name, raw).reshape(6, 512))
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(dequantize(kept, rows), dequantize(kept)[rows])


def test_q6_k_torch_path_within_activation_bound() -> None:
    # q6_k's own steps (w = sc * (q - 32) under d) err only by the activations' int8 step.
    quant = from_gguf("Q6_K", random_blocks("Q6_K", 40, 256, 4), (40, 256), super_blocks=True)
    x = torch.randn(9, 256)
    w = dequantize(quant)
    y = QuantLinear(quant, kernel="torch")(x)
    assert (y - x @ w.T).abs().le(activation_bound(x, w)).all()


def test_quant_weight_checks_its_shapes() -> None:
    with pytest.raises(AssertionError):
        QuantWeight("q8_0", 2, 32, torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1), None)


def test_quant_kernel_is_a_validated_config_knob() -> None:
    from radixkv.config import QUANT_KERNELS, EngineConfig
    from radixkv.errors import ConfigError

    assert EngineConfig().quant_kernel == "auto" and "torch" in QUANT_KERNELS
    with pytest.raises(ConfigError) as error:
        EngineConfig(quant_kernel="avx3")
    assert error.value.param == "quant_kernel"


@pytest.mark.parametrize("type_name", ["Q6_K", "Q4_K", "Q4_0", "Q8_0"])
def test_conversion_in_row_chunks_equals_one_pass(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import radixkv.cpu.quant as quant

    raw = random_blocks(type_name, 10, 256, 4)
    whole = from_gguf(type_name, raw, (10, 256))
    monkeypatch.setattr(quant, "_CHUNK_WEIGHTS", 3 * 256)  # chunks of 3 rows: 3, 3, 3, 1
    chunked = from_gguf(type_name, raw, (10, 256))
    assert chunked.format == whole.format and chunked.scales.dtype == whole.scales.dtype
    assert torch.equal(chunked.quants, whole.quants) and torch.equal(chunked.scales, whole.scales)
    assert torch.equal(dequantize(chunked), dequantize(whole))
    if type_name == "Q6_K":
        assert torch.equal(whole.quants, quantize_q8_0(reference("Q6_K", raw).reshape(10, 256)).quants)


def test_wrong_byte_count_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 340 bytes"):
        from_gguf("Q8_0", np.zeros(339, dtype=np.uint8), (10, 32))


def test_requantized_q5_1_within_a_tenth_of_its_own_step_on_gaussian_weights() -> None:
    values = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32) * 0.02
    raw = gguf_quants.quantize(values, GGMLQuantizationType.Q5_1)
    expected = reference("Q5_1", raw).reshape(64, 32, 32)
    d = torch.from_numpy(np.ascontiguousarray(raw.reshape(64, 32, 24)[..., :2]).view(np.float16)[..., 0].astype(np.float32))
    error = (dequantize(from_gguf("Q5_1", raw, (64, 1024))).reshape(64, 32, 32) - expected).abs().amax(dim=-1)
    assert bool((error <= 0.1 * d.abs()).all()), float((error / d.abs()).max())
