"""Linear layers whose bf16 weights are packed once at load for the CPU: into AMX tiles' layout
(radixkv/cpu/csrc/amx_linear.c) where the CPU has them, else into oneDNN's blocked layout.

F.linear hands oneDNN a plain weight, which it re-lays out on every call; at decode's few rows
that costs more than the product itself. oneDNN with a prepacked weight still spends ~20 us of
set-up per call; the AMX kernel does not, and is ~1.3x faster at 1 to 32 rows (scenarios/cpu_kernels.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from radixkv.cpu import native

# The row count oneDNN tunes the packed layout for: a decode step's batch, where it matters most.
PACK_FOR_ROWS = 32


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear (the AMX kernel's fallback)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def _amx_library(weight: Tensor):
    """The native library where it runs this weight on AMX tiles (bf16, in_features % 32 == 0), else None."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[1] % 32:
        return None
    library = native.load()
    return library if library is not None and library.radixkv_amx_linear_available() else None


class PackedLinear(nn.Module):
    """y = x W^T + b for 2-D x, W held packed (not readable as a plain matrix).

    rows_independent: each output row's bits depend on its input row alone, never on how many
    rows the call has (true of the AMX kernel; oneDNN picks kernels by row count).
    native=False keeps oneDNN even where the AMX kernel would run (EngineConfig.native_kernels).
    """

    def __init__(self, linear: nn.Linear, native: bool = True) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._amx = _amx_library(weight) if native else None
        self.rows_independent = self._amx is not None
        if self._amx is not None:
            packed = torch.empty(self._amx.radixkv_amx_packed_words(*weight.shape), dtype=torch.bfloat16)
            self._amx.radixkv_amx_pack(weight.contiguous().data_ptr(), *weight.shape, packed.data_ptr())
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        self.packed_weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        # The kernel adds the bias in fp32 before rounding the sum once.
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        if self._amx is None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected bf16 input [rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        self._amx.radixkv_amx_linear(
            x.data_ptr(), x.stride(0), x.shape[0], self.in_features, self.packed_weight.data_ptr(),
            self.out_features, bias, y.data_ptr(), y.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def extra_repr(self) -> str:
        kernel = "amx" if self._amx is not None else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, kernel={kernel}"


def prepack_linears(model: nn.Module, native: bool = True) -> int:
    """Replace every nn.Linear in model by a PackedLinear; returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, native))
    return len(targets)
