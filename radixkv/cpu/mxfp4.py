"""Grouped expert linears over MXFP4 blocks (csrc/moe_mxfp4.c, gpt-oss's experts) and their torch
reference: each routed expert's rows read in place from the file and multiplied with its tokens.

torch_mxfp4_linear is the reference the kernel matches bit for bit (the order of operations is
csrc/moe_mxfp4.c's header comment); the kernel's AVX-512, AVX2 and portable paths give those bits.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from radixkv.cpu import native

# A block of 32 values is one E8M0 scale byte and 16 bytes of e2m1 codes, low nibbles the first
# 16 values; these are the codes' values doubled (ggml's kvalues_mxfp4), so the scale is
# 2^(e - 128), half the E8M0 value.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# The kernel's paths (bits of radixkv_moe_mxfp4_kernels), fastest first.
KERNELS = {"avx512": 4, "avx2": 2, "portable": 1}
_LANES = 16


def compiled_kernels() -> list[str]:
    """The paths this CPU's build runs, fastest first; [] without the library."""
    library = native.load()
    if library is None:
        return []
    bits = library.radixkv_moe_mxfp4_kernels()
    return [name for name, bit in KERNELS.items() if bits & bit]


def dequantize_mxfp4(blocks: np.ndarray, width: int) -> Tensor:
    """MXFP4 rows [rows, row bytes] as fp32 [rows, width]: the values gguf-py's dequantize gives,
    bit for bit (each is exact in fp32)."""
    with warnings.catch_warnings():  # a read-only map of the file: read here, never written
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.ascontiguousarray(blocks)).view(-1, width // 32, 17)
    exponent = data[..., 0].to(torch.int32)
    # The scale's bits as ggml builds them (e < 2: the subnormals 2^-128 and 2^-127).
    bits = torch.where(exponent < 2, torch.tensor(0x00200000, dtype=torch.int32) << exponent, (exponent - 1) << 23)
    scale = bits.view(torch.float32)
    codes = data[..., 1:]
    nibbles = torch.cat([codes & 0x0F, codes >> 4], dim=-1).long()  # [rows, blocks, 32]
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[nibbles]
    return (scale[..., None] * values).reshape(-1, width)


def torch_mxfp4_linear(x: Tensor, raw: np.ndarray, in_features: int, bias: Tensor | None = None) -> Tensor:
    """fp32 y = x W^T (+ bias) for fp32 x [m, in] and W's MXFP4 blocks raw (uint8 [out, row
    bytes]), summed in the kernel's 16 lanes: lane l takes x[i0 + l] * w[i0 + l] for each 16
    values in order, then the lanes are halved 16 -> 1 and the bias added."""
    w = dequantize_mxfp4(raw, in_features).view(-1, in_features // _LANES, _LANES)
    xs = x.float().reshape(x.shape[0], 1, in_features // _LANES, _LANES)
    lanes = torch.zeros(x.shape[0], w.shape[0], _LANES)
    for i in range(in_features // _LANES):
        lanes = lanes + xs[:, :, i] * w[None, :, i]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    y = lanes[..., 0]
    return y if bias is None else y + bias.float()


def native_mxfp4(weights: np.ndarray, x: Tensor, experts: Tensor, offsets: Tensor, x_rows: Tensor, out: Tensor,
                 bias: Tensor | None = None, kernel: str | None = None) -> None:  # fmt: skip
    """out[p] = x[x_rows[p]] W_e^T + bias[e] for the pairs p of each expert e = experts[g]
    (offsets[g] to offsets[g + 1]); weights the stacked experts' MXFP4 blocks [E, rows, row bytes]
    (a memory map), bias fp32 [E, rows] or None, out an fp32 view [pairs, rows] (its row stride
    may be wider); experts, offsets int32. kernel: a name of KERNELS (None: the fastest here)."""
    library = native.load()
    num_experts, n, nbytes = weights.shape
    k = x.shape[1]
    kernel = kernel or compiled_kernels()[0]
    if kernel not in compiled_kernels():
        raise ValueError(f"the MXFP4 expert kernel {kernel!r} is not compiled for this CPU; here: {compiled_kernels()}")
    if nbytes * 32 != k * 17:
        raise ValueError(f"MXFP4 rows of {nbytes} bytes do not hold {k} values")
    assert x.dtype == torch.float32 and x.stride(1) == 1 and out.dtype == torch.float32 and out.stride(1) == 1
    assert experts.dtype == torch.int32 and offsets.dtype == torch.int32 and out.shape[1] == n
    rows = x_rows.to(torch.int32).contiguous()
    # The C code trusts its indices: an expert or row out of range would read outside the tensors.
    if len(experts) and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise IndexError(f"an expert id falls outside the {num_experts} experts")
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= x.shape[0] or out.shape[0] < int(offsets[-1])):
        raise IndexError("a routed row falls outside x or out")
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and tuple(bias.shape) == (num_experts, n)
    status = library.radixkv_moe_mxfp4(
        weights.ctypes.data, n * nbytes, n, k, x.data_ptr(), x.stride(0), experts.data_ptr(), offsets.data_ptr(),
        len(experts), rows.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
        torch.get_num_threads(), KERNELS[kernel],
    )  # fmt: skip
    if status == 2:
        raise MemoryError("the MXFP4 expert kernel could not allocate its row buffers")
    if status:
        raise RuntimeError(f"the MXFP4 expert kernel refused a weight of {n} x {k} (status {status})")
