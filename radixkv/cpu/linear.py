"""Linear layers whose bf16 weights are packed once at load for the CPU: for a native kernel
(radixkv/cpu/csrc/packed_linear.c: AMX tiles, or AVX512_BF16's vdpbf16ps) where the CPU has one,
else into oneDNN's blocked layout.

F.linear hands oneDNN a plain weight, which it re-lays out on every call; at decode's few rows
that costs more than the product itself. oneDNN with a prepacked weight still spends ~20 us of
set-up per call; the native kernels do not (scenarios/cpu_kernels.py measures all three).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from radixkv.config import LINEAR_KERNELS
from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.errors import ConfigError

# The row count oneDNN tunes the packed layout for: a decode step's batch, where it matters most.
PACK_FOR_ROWS = 32
# The native kernels of EngineConfig.linear_kernel (LINEAR_KERNELS), each with its bit in
# radixkv_linear_kernels() and the CPU feature it needs (for messages and test skips).
NATIVE_LINEAR_KERNELS = {"amx": (1, "amx_bf16"), "avx512_bf16": (2, "avx512_bf16")}


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear (the native kernels' fallback)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def available_linear_kernels() -> tuple[str, ...]:
    """The native kernels that run here, fastest first (needs the library, the CPU feature and,
    for AMX, the OS's grant of tiles)."""
    library = native.load()
    if library is None:
        return ()
    bits = library.radixkv_linear_kernels()
    return tuple(name for name, (bit, _) in NATIVE_LINEAR_KERNELS.items() if bits & bit)


def missing_linear_kernel(name: str) -> str:
    """Why a native kernel does not run here ("" where it does), naming the missing piece."""
    if name in available_linear_kernels():
        return ""
    if native.load() is None:
        return "the native kernels did not build (no C compiler, or not Linux)"
    feature = NATIVE_LINEAR_KERNELS[name][1]
    if feature not in cpu_features().flags:
        return f"this CPU lacks {feature}"
    return f"the OS refused {feature}'s state to this process"


def resolve_linear_kernel(requested: str, native_kernels: bool = True) -> str:
    """The kernel EngineConfig.linear_kernel stands for: 'auto' -> the fastest native kernel that
    runs here, else oneDNN; a named native kernel that cannot run is a ConfigError."""
    if requested == "onednn" or not native_kernels:
        return "onednn"
    if requested == "auto":
        return next(iter(available_linear_kernels()), "onednn")
    if requested not in NATIVE_LINEAR_KERNELS:
        raise ConfigError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {requested!r}", param="linear_kernel")
    reason = missing_linear_kernel(requested)
    if reason:
        raise ConfigError(f"linear_kernel={requested!r} cannot run here: {reason}", param="linear_kernel")
    return requested


class PackedLinear(nn.Module):
    """y = x W^T + b for 2-D x, W held packed (not readable as a plain matrix).

    kernel: "amx" or "avx512_bf16" (a native kernel that runs here, see resolve_linear_kernel)
    or "onednn". Widths the native kernels cannot take (in_features % 32) fall back to oneDNN.
    rows_independent: each output row's bits depend on its input row alone, never on how many
    rows the call has (true of the native kernels; oneDNN picks kernels by row count).
    """

    def __init__(self, linear: nn.Linear, kernel: str = "onednn") -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        native_ok = kernel in NATIVE_LINEAR_KERNELS and weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0
        self._library = native.load() if native_ok else None
        self.kernel = kernel if self._library is not None else "onednn"
        self.rows_independent = self._library is not None
        if self._library is not None:
            self.kernel_bit = NATIVE_LINEAR_KERNELS[self.kernel][0]
            packed = torch.empty(self._library.radixkv_packed_words(*weight.shape), dtype=torch.bfloat16)
            self._library.radixkv_pack_weight(weight.contiguous().data_ptr(), *weight.shape, packed.data_ptr())
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        self.packed_weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        # The kernel adds the bias in fp32 before rounding the sum once.
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        if self._library is None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected bf16 input [rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        status = self._library.radixkv_packed_linear(
            self.kernel_bit, x.data_ptr(), x.stride(0), x.shape[0], self.in_features, self.packed_weight.data_ptr(),
            self.out_features, bias, y.data_ptr(), y.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the {self.kernel} linear kernel does not run on this CPU")
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, kernel={self.kernel}"


def prepack_linears(model: nn.Module, kernel: str = "onednn") -> int:
    """Replace every nn.Linear in model by a PackedLinear running `kernel` (resolved: see
    resolve_linear_kernel); returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, kernel))
    return len(targets)
