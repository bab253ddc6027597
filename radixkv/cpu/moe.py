"""Grouped expert linears over a GGUF's own blocks (csrc/moe.c) and their torch reference: a
layer's routed experts multiplied with the rows routed to each, every expert read in place.

torch_block_linear is the reference the native kernel matches bit for bit (the order of
operations is csrc/moe.c's header comment); moe_kernel picks between them (EngineConfig.moe_kernel).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from radixkv.config import MOE_KERNELS
from radixkv.cpu import native
from radixkv.cpu.quant_linear import quantize_activations
from radixkv.errors import ConfigError

# GGUF block types the grouped kernel reads in place, with csrc/moe.c's type ids.
BLOCK_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
_QK_K = 256
_BLOCK = 32


def resolve_moe_kernel(requested: str, native_kernels: bool = True) -> str:
    """EngineConfig.moe_kernel as it runs here: "auto" -> "native" where the library builds, else
    "torch"; a native kernel without the library (or native_kernels off) is a ConfigError."""
    if requested not in MOE_KERNELS:
        raise ConfigError(f"moe_kernel must be one of {MOE_KERNELS}, got {requested!r}", param="moe_kernel")
    if requested == "torch":
        return "torch"
    available = native_kernels and native.load() is not None
    if requested == "auto":
        return "native" if available else "torch"
    if not native_kernels:
        raise ConfigError(f"moe_kernel={requested!r} is a native kernel, and native_kernels is False", param="moe_kernel")
    if not available:
        raise ConfigError(f"moe_kernel={requested!r} cannot run here: the native kernels did not build", param="moe_kernel")
    return requested


def row_bytes(type_name: str, in_features: int) -> int:
    values = _QK_K if type_name.endswith("_K") else _BLOCK
    if in_features % values:
        raise ValueError(f"a {type_name} row holds whole blocks of {values} values, not {in_features}")
    return in_features // values * _BLOCK_BYTES[type_name]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def decode_blocks(type_name: str, raw: np.ndarray, in_features: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """A matrix's blocks (uint8 [rows, row bytes]) as (integer weights w, fp32 [rows, in], each
    value exact; scales [rows, in / 32]; mins [rows, in / 32] or None): value = s * w (+ m) per
    block of 32, w and s as csrc/moe.c's header defines them (Q4_K: s = d * sc, m = -(dmin *
    mn); Q6_K: w = sub-block scale * (q - 32), s = d)."""
    rows = raw.shape[0]
    nb = in_features // _BLOCK
    if type_name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        blocks = raw.reshape(rows, nb, _BLOCK_BYTES[type_name])
        d = _f16(blocks, 0)
        mins = None
        if type_name == "Q8_0":
            w = blocks[..., 2:].view(np.int8).astype(np.float32)
        elif type_name == "Q5_0":
            high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)
            high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
            nib = blocks[..., 6:].astype(np.int32)
            w = (np.concatenate((nib & 15, nib >> 4), axis=-1) | (high << 4)).astype(np.float32) - 16.0
        else:
            at = 4 if type_name == "Q4_1" else 2
            nib = blocks[..., at:]
            w = np.concatenate((nib & 15, nib >> 4), axis=-1).astype(np.float32)
            mins = _f16(blocks, 2) if type_name == "Q4_1" else d * np.float32(-8.0)
        return _t(w.reshape(rows, in_features)), _t(d), None if mins is None else _t(mins)
    blocks = raw.reshape(rows, in_features // _QK_K, _BLOCK_BYTES[type_name])
    if type_name == "Q4_K":
        d, dmin, sc, mn, q = _q4_k_fields(blocks)
        w = q.astype(np.float32)
        scales, mins = d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))
        return _t(w.reshape(rows, in_features)), _t(scales.reshape(rows, nb)), _t(mins.reshape(rows, nb))
    if type_name == "Q6_K":
        ql, qh = blocks[..., :128].astype(np.int32), blocks[..., 128:192].astype(np.int32)
        sc = blocks[..., 192:208].view(np.int8).astype(np.int32)  # [rows, nsb, 16]
        d = _f16(blocks, 208)
        parts = []
        for h in range(2):
            for g in range(4):
                low = (ql[..., 64 * h + 32 * (g & 1) : 64 * h + 32 * (g & 1) + 32] >> (4 * (g >> 1))) & 15
                q = (low | (((qh[..., 32 * h : 32 * h + 32] >> (2 * g)) & 3) << 4)) - 32
                scale = np.repeat(sc[..., [8 * h + 2 * g, 8 * h + 2 * g + 1]], 16, axis=-1)
                parts.append(q * scale)
        w = np.stack(parts, axis=-2).astype(np.float32)  # [rows, nsb, 8, 32]
        scales = np.repeat(d[..., None], 8, axis=-1)
        return _t(w.reshape(rows, in_features)), _t(scales.reshape(rows, nb)), None
    raise ValueError(f"no grouped expert kernel for {type_name}; supported: {tuple(BLOCK_TYPES)}")


def _q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K blocks [rows, super-blocks, 144] -> d, dmin (fp32 [rows, sb]), the 6-bit scales and
    mins (int32 [rows, sb, 8]) and the quants (int32 [rows, sb, 8, 32], sub-block 2i + h)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    packed = blocks[..., 4:16]
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), axis=-1).astype(np.int32)
    mn = np.concatenate((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), axis=-1).astype(np.int32)
    nibbles = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 1, 32)
    q = np.concatenate((nibbles & 15, nibbles >> 4), axis=-2).astype(np.int32)
    return d, dmin, sc, mn, q.reshape(*blocks.shape[:2], 8, 32)


def _t(values: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def torch_block_linear(x: Tensor, type_name: str, raw: np.ndarray, in_features: int) -> Tensor:
    """fp32 y = x W^T for fp32 x [m, in] and W's blocks raw (uint8 [out, row bytes]), in the
    order csrc/moe.c documents; integer block sums below 2^24, so fp32 holds them exactly."""
    if type_name in ("Q4_K", "Q6_K"):
        return _kquant_linear(x, type_name, raw, in_features)
    w, scales, mins = decode_blocks(type_name, raw, in_features)
    xq, sx = quantize_activations(x)
    xq_blocks = xq.reshape(x.shape[0], -1, _BLOCK)
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for b in range(in_features // _BLOCK):
        dots = xq_blocks[:, b] @ w[:, b * _BLOCK : (b + 1) * _BLOCK].T
        acc = acc + (sx[:, b : b + 1] * scales[:, b]) * dots
        if mins is not None:
            acc = acc + mins[:, b] * (sx[:, b : b + 1] * xq_blocks[:, b].sum(dim=-1, keepdim=True))
    return acc


def _kquant_linear(x: Tensor, type_name: str, raw: np.ndarray, in_features: int) -> Tensor:
    """K-quant rows against x quantized per 256, in csrc/moe.c's 16 lanes: each super-block's
    integer lane sums (exact in float64; below 2^24, so exact in fp32 too), then per lane
    acc = acc + (d * sx) * lane, super-blocks in order, halved 16 -> 1; Q4_K's mins likewise in
    8 lanes (sub-block j), subtracted last."""
    rows, nsb, m = raw.shape[0], in_features // _QK_K, x.shape[0]
    blocks = raw.reshape(rows, nsb, _BLOCK_BYTES[type_name])
    xq, sx = quantize_activations(x, _QK_K)
    xq = xq.double().reshape(m, nsb, _QK_K)
    if type_name == "Q4_K":
        d, dmin, sc, mn, q = _q4_k_fields(blocks)
        w = torch.from_numpy((q * sc[..., None]).astype(np.float64))
        # value 32j + 4t + e (j = 4a + 2b + c) goes to lane 8b + t
        lanes = torch.einsum("msabcte,nsabcte->mnsbt", xq.reshape(m, nsb, 2, 2, 2, 8, 4), w.reshape(rows, nsb, 2, 2, 2, 8, 4))
        mins = torch.from_numpy(mn).double()[None] * xq.reshape(m, 1, nsb, 8, _BLOCK).sum(-1)  # [m, rows, nsb, 8]
        dmin = torch.from_numpy(dmin)
    else:  # Q6_K: w = sc16 * (q - 32); value 64i + 4l + e goes to lane l
        values, scales, _ = decode_blocks(type_name, raw, in_features)
        w, d = values.double().reshape(rows, nsb, 4, 16, 4), scales[:, ::8].numpy()
        lanes = torch.einsum("msile,nsile->mnsl", xq.reshape(m, nsb, 4, 16, 4), w)
    lanes, d = lanes.reshape(m, rows, nsb, 16).float(), torch.from_numpy(d)
    acc = torch.zeros(m, rows, 16)
    for sb in range(nsb):
        acc = acc + (d[:, sb] * sx[:, sb : sb + 1])[..., None] * lanes[:, :, sb]
    if type_name == "Q6_K":
        return _halve(acc)
    mins, macc = mins.float(), torch.zeros(m, rows, 8)
    for sb in range(nsb):
        macc = macc + (dmin[:, sb] * sx[:, sb : sb + 1])[..., None] * mins[:, :, sb]
    return _halve(acc) - _halve(macc)


def _halve(lanes: Tensor) -> Tensor:
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def native_grouped(
    type_name: str, weights: np.ndarray, x: Tensor, experts: list[int] | Tensor, offsets: list[int] | Tensor, x_rows: Tensor,
    out: Tensor, vnni: bool = True,
) -> None:  # fmt: skip
    """out[p] = x[x_rows[p]] W_e^T for the pairs p of each expert e = experts[g] (offsets[g] to
    offsets[g + 1]), weights the stacked experts' blocks [E, rows, row bytes] (a memory map),
    out an fp32 view [pairs, rows] (its row stride may be wider). vnni=False: the scalar loop.
    experts and offsets may come as int32 tensors already (one conversion for a layer's calls)."""
    library = native.load()
    num_experts, n, nbytes = weights.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and out.dtype == torch.float32 and out.stride(1) == 1
    ids = experts if isinstance(experts, Tensor) else torch.tensor(experts, dtype=torch.int32)
    starts = offsets if isinstance(offsets, Tensor) else torch.tensor(offsets, dtype=torch.int32)
    assert ids.dtype == torch.int32 and starts.dtype == torch.int32
    rows = x_rows.to(torch.int32).contiguous()
    status = library.radixkv_moe_grouped(
        BLOCK_TYPES[type_name], weights.ctypes.data, n * nbytes, n, x.shape[1], x.data_ptr(), x.stride(0), x.shape[0],
        ids.data_ptr(), starts.data_ptr(), len(experts), rows.data_ptr(), out.data_ptr(), out.stride(0),
        torch.get_num_threads(), int(vnni),
    )  # fmt: skip
    if status:
        raise RuntimeError(f"the grouped expert kernel refused a {type_name} weight of {n} x {x.shape[1]} (status {status})")


def native_row(
    types: tuple[str, str, str], weights: tuple[np.ndarray, np.ndarray, np.ndarray], x: Tensor, ids: Tensor, routing: Tensor,
    vnni: bool = True,
) -> Tensor:  # fmt: skip
    """One token's expert block, as SparseMoE.combine computes it over the grouped kernel: x [1, H]
    (fp32 or bf16), its top-k ids (int64 [k]) and routing weights ([k], x's dtype) -> [1, H] in
    x's dtype (RowCalls, built for this one call)."""
    return RowCalls(types, weights)(x, ids, routing, vnni)


class RowCalls:
    """native_row for one layer's stacked experts, every argument that does not change from token
    to token bound once: one native call (radixkv_moe_token: gate and up over x quantized once,
    SiLU(gate) * up, down and the weighted sum in ascending expert order). Its scratch is reused,
    so one caller at a time: the engine's step loop. Each call returns a new output tensor."""

    def __init__(self, types: tuple[str, str, str], weights: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        library = native.load()
        (gate_type, up_type, down_type), (gate, up, down) = types, weights
        self.types, self.size, self.hidden = types, gate.shape[1], down.shape[1]
        # The maps' addresses read once (numpy builds a ctypes object each time .ctypes is read);
        # the maps are held, so the addresses stay valid.
        self._maps = weights
        self._token = library.radixkv_moe_token
        self._experts = (
            BLOCK_TYPES[gate_type], gate.ctypes.data, BLOCK_TYPES[up_type], up.ctypes.data,
            BLOCK_TYPES[down_type], down.ctypes.data, self.size,
        )  # fmt: skip
        self._floats = library.radixkv_moe_token_floats
        self._scratch = torch.empty(0)  # sized for the last top_k

    def __call__(self, x: Tensor, ids: Tensor, routing: Tensor, vnni: bool = True) -> Tensor:
        """native_row's result; ids and routing [k] or [1, k] (route's rows, not selected: a
        view op fewer each)."""
        hidden, top_k = self.hidden, ids.numel()
        dtype = x.dtype
        assert dtype in (torch.float32, torch.bfloat16) and routing.dtype == dtype and ids.dtype == torch.int64
        assert x.shape == (1, hidden) and routing.numel() == top_k
        x, ids, routing = x.contiguous(), ids.contiguous(), routing.contiguous()
        floats = self._floats(hidden, top_k, self.size)
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats)
        out = torch.empty(1, hidden, dtype=dtype)
        status = self._token(
            x.data_ptr(), int(dtype == torch.bfloat16), hidden, ids.data_ptr(), routing.data_ptr(), top_k, *self._experts,
            self._scratch.data_ptr(), out.data_ptr(), torch.get_num_threads(), int(vnni),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"the one-token expert kernel refused {self.types} experts of {self.size} x {hidden} (status {status})")
        return out


def native_grouped_f32(weights: Tensor, x: Tensor, experts: list[int], offsets: list[int], x_rows: Tensor, out: Tensor) -> None:
    """The fp32 kernel for float experts: weights [E, rows, in] contiguous fp32."""
    library = native.load()
    _, n, k = weights.shape
    assert weights.dtype == torch.float32 and weights.is_contiguous() and x.stride(1) == 1 and out.stride(1) == 1
    ids = torch.tensor(experts, dtype=torch.int32)
    starts = torch.tensor(offsets, dtype=torch.int32)
    rows = x_rows.to(torch.int32).contiguous()
    library.radixkv_moe_grouped_f32(
        weights.data_ptr(), n * k, n, k, x.data_ptr(), x.stride(0), ids.data_ptr(), starts.data_ptr(), len(experts),
        rows.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip


def has_vnni() -> bool:
    library = native.load()
    return library is not None and bool(library.radixkv_moe_has_vnni())
