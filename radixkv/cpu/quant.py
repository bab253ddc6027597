"""Quantized weight formats kept in their own bytes: QuantWeight (q8_0 or q4_1 blocks of 32 along
in_features), its conversion from a GGUF tensor's blocks (from_gguf) or a float weight
(quantize_q8_0), and the reference dequantization the kernels are tested against.

The kernels multiply q8_0 and q4_1, and (512-bit kernel and torch) GGUF's own Q4_K and Q6_K
super-blocks kept as the file has them (q4_k, q6_k: SUPER_FORMATS; q4_k computes q4_1's bits,
q6_k its own: w = sc * (q - 32) per 16 inputs under the super-block's d; from_gguf's
super_blocks). Otherwise GGUF's other block types map onto q8_0 and q4_1 once at load: Q4_0 and Q4_K exactly into q4_1 (a scale and a min per 32), Q5_0 exactly
into q8_0 (its 5-bit quants minus 16 fit int8 under the block's own scale); Q5_1, Q5_K and Q6_K
are requantized into q8_0 per block of 32 (absmax / 127), within half an int8 step of the
original value: 127 levels against their 31 or 63. tests/cpu/test_quant.py checks max |error|
<= 0.5 * absmax / 127 * (1 + 2^-10) per block on random blocks of every bit pattern; on
Gaussian weights that gguf quantized to Q5_1 the error stays under 0.1 of Q5_1's own step d.
Blocks whose sub-scales or min dwarf their spread (possible in random bytes, rare in real
weights) keep the int8 bound only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

KERNEL_FORMATS = ("q8_0", "q4_1", "q4_k", "q6_k")  # the layouts the kernels multiply
SUPER_FORMATS = {"q4_k": 144, "q6_k": 210}  # GGUF's bytes per super-block of 256, kept as they are
BLOCK = 32  # weights per block along in_features, in both formats
EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0")
REQUANTIZED_TYPES = ("Q5_1", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*EXACT_TYPES, *REQUANTIZED_TYPES)
_QK_K = 256  # weights per K-quant super-block


@dataclass(slots=True, frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight in blocks of 32 along in_features.

    q8_0: quants int8 [out, in], w = scale * q.
    q4_1: quants uint8 [out, in // 2], w = scale * q + min with q in 0..15. Nibble order, GGML's
    own: in block b (bytes 16b .. 16b + 15 of a row), byte j holds quant 32b + j in its low
    nibble and quant 32b + j + 16 in its high nibble.
    scales (and mins, q4_1 only): [out, in // 32], fp16 where the source's value is fp16 and
    exact, else fp32. Dequantized in fp32 as scale * q (+ min): a product, then a sum.
    q4_k, q6_k: quants uint8 [out, in // 256 * bytes], the GGUF's super-blocks row by row;
    scales an empty [out, 0] (they live in the blocks), no mins.
    """

    format: str
    out_features: int
    in_features: int
    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __post_init__(self) -> None:
        assert self.format in KERNEL_FORMATS, self.format
        assert self.in_features % BLOCK == 0, self.in_features
        if self.format in SUPER_FORMATS:
            assert self.in_features % _QK_K == 0 and self.mins is None, self.in_features
            width = self.in_features // _QK_K * SUPER_FORMATS[self.format]
            assert tuple(self.quants.shape) == (self.out_features, width) and tuple(self.scales.shape) == (self.out_features, 0)
            return
        width = self.in_features if self.format == "q8_0" else self.in_features // 2
        assert tuple(self.quants.shape) == (self.out_features, width), (self.quants.shape, self.out_features, width)
        blocks = (self.out_features, self.in_features // BLOCK)
        assert tuple(self.scales.shape) == blocks
        assert (self.mins is not None) == (self.format == "q4_1")
        assert self.mins is None or tuple(self.mins.shape) == blocks

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.quants.nbytes + self.scales.nbytes + extra

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight of output rows `index` (a subset or permutation), in that order; copies."""
        index = index.to(torch.long)
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantWeight(
            self.format, int(index.numel()), self.in_features, self.quants[index].contiguous(), self.scales[index].contiguous(), mins
        )

    def with_float_scales(self) -> QuantWeight:
        """The same weight with fp32 scales and mins (the native kernels read fp32; exact)."""
        mins = None if self.mins is None else self.mins.float().contiguous()
        return QuantWeight(self.format, self.out_features, self.in_features, self.quants.contiguous(), self.scales.float().contiguous(), mins)


def unpack_q4(quants: torch.Tensor) -> torch.Tensor:
    """uint8 [..., in // 2] nibble pairs (QuantWeight's order) -> uint8 quants [..., in]."""
    blocks = quants.reshape(*quants.shape[:-1], -1, BLOCK // 2)
    low, high = blocks & 0x0F, blocks >> 4
    return torch.cat((low, high), dim=-1).reshape(*quants.shape[:-1], quants.shape[-1] * 2)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """uint8 quants 0..15 [..., in] -> nibble pairs [..., in // 2] (QuantWeight's order)."""
    blocks = q.to(torch.uint8).reshape(*q.shape[:-1], -1, BLOCK)
    packed = blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2 :] << 4)
    return packed.reshape(*q.shape[:-1], q.shape[-1] // 2)


def dequantize(weight: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight in fp32 [out, in] (with rows: only those rows, e.g. an embedding lookup);
    q4_k as its q4_1 form, q6_k as gguf computes it, (d * sc) * (q - 32)."""
    if weight.format in SUPER_FORMATS:
        weight = weight if rows is None else weight.rows(rows)
        if weight.format == "q4_k":
            return dequantize(as_kernel_format(weight))
        q, sc, d = q6_k_parts(weight)
        n = weight.out_features
        scale = (d.repeat_interleave(16, dim=1) * sc.float()).unsqueeze(-1)  # [n, in / 16, 1]
        return (scale * q.float().reshape(n, -1, 16)).reshape(n, weight.in_features)
    quants, scales, mins = weight.quants, weight.scales, weight.mins
    if rows is not None:
        rows = rows.to(torch.long)
        quants, scales = quants[rows], scales[rows]
        mins = None if mins is None else mins[rows]
    q = quants if weight.format == "q8_0" else unpack_q4(quants)
    n = q.shape[0]
    blocks = q.reshape(n, -1, BLOCK).float() * scales.float().unsqueeze(-1)
    if mins is not None:
        blocks = blocks + mins.float().unsqueeze(-1)
    return blocks.reshape(n, weight.in_features)


def quantize_q8_0(weight: torch.Tensor) -> QuantWeight:
    """A float weight [out, in] (in % 32 == 0) as q8_0: per block of 32, scale = absmax / 127
    in fp32, q = round(w / scale) (half to even); |w - scale * q| <= scale / 2 (plus rounding)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK != 0:
        raise ValueError(f"quantize_q8_0 takes a 2-D weight with in_features a multiple of {BLOCK}, got {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    blocks = weight.detach().float().reshape(out_features, -1, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantWeight("q8_0", out_features, in_features, q.reshape(out_features, in_features), scales.contiguous(), None)


def q6_k_parts(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A q6_k weight's values: (q - 32 as int8 [out, in], the int8 scale of each 16 inputs
    [out, in // 16], d fp32 [out, in // 256]), GGUF's element order."""
    assert weight.format == "q6_k"
    n = weight.out_features
    blocks = weight.quants.numpy().reshape(n, -1, 210)
    ql, qh = blocks[..., :128].reshape(n, -1, 2, 2, 32), blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    # element 128h + 32g + l: ql[64h + 32(g & 1) + l] >> 4(g >> 1), qh[32h + l] >> 2g
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2)  # [n, nsb, h, g, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, -1)
    return torch.from_numpy(q.reshape(n, weight.in_features)), torch.from_numpy(sc.copy()), _f32(_f16(blocks, 208))


def as_kernel_format(weight: QuantWeight) -> QuantWeight:
    """A q4_k weight as q4_1 (exact: the same sums) and a q6_k one requantized into q8_0 (see
    the module docstring), for a kernel without the super-block formats; others as they are."""
    if weight.format not in SUPER_FORMATS:
        return weight
    name = weight.format.upper()
    return from_gguf(name, weight.quants.numpy(), (weight.out_features, weight.in_features))


def from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int], super_blocks: bool = False) -> QuantWeight:
    """A GGUF tensor's blocks (raw: its bytes as gguf.GGUFReader gives them, uint8) as a
    QuantWeight of `shape` (out, in) in PyTorch order. Q8_0, Q4_0, Q4_1, Q4_K and Q5_0 convert
    exactly (dequantize() equals gguf.quants.dequantize bit for bit); Q5_1, Q5_K and Q6_K are
    requantized into q8_0 (see the module docstring). super_blocks: Q4_K and Q6_K kept as their
    blocks (q4_k, q6_k), for the kernels that multiply them."""
    name = type_name.upper()
    out_features, in_features = shape
    if name not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF tensor type {type_name!r} is not supported as a quantized weight; supported: {SUPPORTED_TYPES}")
    if in_features % (_QK_K if name.endswith("_K") else BLOCK) != 0:
        raise ValueError(f"a {name} tensor's rows must hold whole blocks, got shape {shape}")
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    block_size = _QK_K if name.endswith("_K") else BLOCK
    block_bytes = _BLOCK_BYTES[name]
    expected = out_features * (in_features // block_size) * block_bytes
    if data.size != expected:
        raise ValueError(f"expected {expected} bytes for a {name} tensor of {out_features} x {in_features}, got {data.size}")
    if super_blocks and name.lower() in SUPER_FORMATS:
        quants = torch.from_numpy(data.reshape(out_features, -1).copy())
        return QuantWeight(name.lower(), out_features, in_features, quants, torch.empty(out_features, 0), None)
    convert = {"Q8_0": _from_q8_0, "Q4_0": _from_q4_0, "Q4_1": _from_q4_1, "Q4_K": _from_q4_k, "Q5_0": _from_q5_0}.get(name)
    return _by_rows(convert or _requantizer(name), data.reshape(out_features, -1), out_features, in_features, compact=convert is not None)


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# Weights converted at a time: each chunk's temporaries (unpacked nibbles, a requantized
# type's float copy) stay small; a whole lm_head's would be a gigabyte or more, the peak memory
# a quantized load must stay under.
_CHUNK_WEIGHTS = 1 << 23


def _by_rows(convert, rows: np.ndarray, out_features: int, in_features: int, compact: bool) -> QuantWeight:
    """convert(rows chunk, row count, in_features) -> QuantWeight with fp32 scales, chunk by
    chunk into one weight; scales and mins as fp16 at the end where every one is exact (compact)."""
    step = max(1, _CHUNK_WEIGHTS // in_features)
    quants = scales = mins = None
    for start in range(0, out_features, step):
        count = min(step, out_features - start)
        part = convert(rows[start : start + count], count, in_features)
        if quants is None:
            fmt = part.format
            quants = torch.empty(out_features, part.quants.shape[1], dtype=part.quants.dtype)
            scales = torch.empty(out_features, in_features // BLOCK, dtype=torch.float32)
            mins = None if part.mins is None else torch.empty_like(scales)
        quants[start : start + count] = part.quants
        scales[start : start + count] = part.scales
        if mins is not None:
            mins[start : start + count] = part.mins
    if compact:
        scales, mins = _compact(scales), None if mins is None else _compact(mins)
    return QuantWeight(fmt, out_features, in_features, quants, scales, mins)


def _requantizer(name: str):
    import gguf.quants  # the loader's own dependency; only this path needs it

    qtype = getattr(gguf.GGMLQuantizationType, name)

    def convert(rows: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
        values = gguf.quants.dequantize(rows, qtype)
        return quantize_q8_0(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(out_features, in_features))

    return convert


def _blocks(data: np.ndarray, out_features: int, in_features: int, block_bytes: int, block_size: int = BLOCK) -> np.ndarray:
    count = out_features * (in_features // block_size)
    assert data.size == count * block_bytes, (data.size, count, block_bytes)
    return data.reshape(out_features, in_features // block_size, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of every block, as fp32 [out, blocks]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _compact(values: torch.Tensor) -> torch.Tensor:
    """fp16 where every value is exactly an fp16, else fp32."""
    half = values.half()
    return half if torch.equal(half.float(), values) else values


def _f32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _from_q8_0(data: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
    blocks = _blocks(data, out_features, in_features, 2 + BLOCK)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out_features, in_features)
    return QuantWeight("q8_0", out_features, in_features, torch.from_numpy(q), _f32(_f16(blocks, 0)), None)


def _from_q4_0(data: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
    # w = d * (q - 8) = d * q + (-8 d): q4_1 with min -8 d, the same nibbles.
    blocks = _blocks(data, out_features, in_features, 2 + BLOCK // 2)
    d = _f16(blocks, 0)
    q = np.ascontiguousarray(blocks[..., 2:]).reshape(out_features, in_features // 2)
    return QuantWeight("q4_1", out_features, in_features, torch.from_numpy(q), _f32(d), _f32(d * np.float32(-8.0)))


def _from_q4_1(data: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
    blocks = _blocks(data, out_features, in_features, 4 + BLOCK // 2)
    q = np.ascontiguousarray(blocks[..., 4:]).reshape(out_features, in_features // 2)
    return QuantWeight("q4_1", out_features, in_features, torch.from_numpy(q), _f32(_f16(blocks, 0)), _f32(_f16(blocks, 2)))


def _from_q5_0(data: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
    # w = d * (q - 16), q in 0..31: q - 16 is an int8 under the same scale.
    blocks = _blocks(data, out_features, in_features, 2 + 4 + BLOCK // 2)
    d = _f16(blocks, 0)
    high_bits = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [out, nb, 1]
    high = ((high_bits >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)  # [out, nb, 32]
    nibbles = blocks[..., 6:]
    low = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)
    q = (low | (high << 4)).astype(np.int8) - np.int8(16)
    return QuantWeight("q8_0", out_features, in_features, torch.from_numpy(q.reshape(out_features, in_features)), _f32(d), None)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (scale, min) codes, [..., 8] each."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mins = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return scales, mins


def _from_q4_k(data: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
    # Super-block of 256: d, dmin (fp16), 8 six-bit (scale, min) codes, 128 bytes of nibbles in
    # which 32 bytes hold sub-blocks 2i (low nibbles) and 2i + 1 (high). Sub-block j is
    # w = (d * sc_j) * q - dmin * m_j: q4_1 with scale d * sc_j and min -(dmin * m_j), both
    # exact in fp32 (11 x 6 bits), so scale * q + min rounds once as gguf's own does.
    blocks = _blocks(data, out_features, in_features, 4 + 12 + _QK_K // 2, _QK_K)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    codes_sc, codes_m = _k_scales_mins(blocks[..., 4:16])
    scales = d[..., None] * codes_sc.astype(np.float32)
    mins = -(dmin[..., None] * codes_m.astype(np.float32))
    nibbles = blocks[..., 16:].reshape(out_features, -1, 4, 1, 32)
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-2)  # [out, nsb, 4, 2, 32]: sub-block 2i + h
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(out_features, in_features))
    return QuantWeight(
        "q4_1", out_features, in_features, pack_q4(q), _f32(scales.reshape(out_features, -1)), _f32(mins.reshape(out_features, -1))
    )


def stack_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of one format and width stacked along the outputs, in order."""
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    # Scales stay fp16 only where every part's are; fp16 -> fp32 is exact.
    scale_dtype = first.scales.dtype if all(w.scales.dtype == first.scales.dtype for w in weights) else torch.float32
    mins = None if first.mins is None else torch.cat([w.mins.to(scale_dtype) for w in weights])
    return QuantWeight(
        first.format,
        sum(w.out_features for w in weights),
        first.in_features,
        torch.cat([w.quants for w in weights]),
        torch.cat([w.scales.to(scale_dtype) for w in weights]),
        mins,
    )
