"""Linear layers whose weights are packed once at load for the CPU: bf16 weights for a native
kernel (radixkv/cpu/csrc/packed_linear.c: AMX tiles, or AVX512_BF16's vdpbf16ps) where the CPU
has one, else into oneDNN's blocked layout; fp32 weights for AVX2's FMAs (csrc/linear_f32.c).

F.linear hands oneDNN a plain weight, which it re-lays out on every call; at decode's few rows
that costs more than the product itself. oneDNN with a prepacked weight still spends ~20 us of
set-up per call; the native kernels do not (scenarios/cpu_kernels.py measures all three). In
fp32, torch's linear at decode's rows runs well below its own large-matrix rate (lm_head 2-2.7x
slower than the AVX2 kernel on Zen 3), and at prefill's rows the two are even.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from radixkv.config import LINEAR_KERNELS
from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.errors import ConfigError

# The row count oneDNN tunes the packed layout for: a decode step's batch, where it matters most.
PACK_FOR_ROWS = 32
# The native kernels of EngineConfig.linear_kernel (LINEAR_KERNELS), fastest first, each with
# its bit in radixkv_linear_kernels(), the CPU feature it needs (for messages and test skips)
# and the weight dtype it runs.
NATIVE_LINEAR_KERNELS = {
    "amx": (1, "amx_bf16", torch.bfloat16),
    "avx512_bf16": (2, "avx512_bf16", torch.bfloat16),
    "avx2": (4, "avx2", torch.float32),
}


def linear_kernels_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The native kernels that take weights of this dtype, fastest first."""
    return tuple(name for name, spec in NATIVE_LINEAR_KERNELS.items() if spec[2] == dtype)


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear (the native kernels' fallback)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def available_linear_kernels(dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The native kernels that run here, fastest first (needs the library, the CPU feature and,
    for AMX, the OS's grant of tiles); with a dtype, only those taking weights of that dtype."""
    library = native.load()
    if library is None:
        return ()
    bits = library.radixkv_linear_kernels()
    return tuple(
        name for name, (bit, _, runs) in NATIVE_LINEAR_KERNELS.items() if bits & bit and dtype in (None, runs)
    )


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


def resolve_linear_kernel(requested: str, native_kernels: bool = True, dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel EngineConfig.linear_kernel stands for with weights of `dtype`: 'auto' -> the
    fastest native kernel for that dtype that runs here, else 'onednn' (torch's library); a
    named native kernel that cannot run, or runs another dtype, is a ConfigError."""
    if requested == "onednn" or not native_kernels:
        return "onednn"
    if requested == "auto":
        return next(iter(available_linear_kernels(dtype)), "onednn")
    if requested not in NATIVE_LINEAR_KERNELS:
        raise ConfigError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {requested!r}", param="linear_kernel")
    if requested not in linear_kernels_for(dtype):
        runs = str(NATIVE_LINEAR_KERNELS[requested][2]).removeprefix("torch.")
        raise ConfigError(
            f"linear_kernel={requested!r} runs {runs} weights, and this model loads as {str(dtype).removeprefix('torch.')}",
            param="linear_kernel",
        )
    reason = missing_linear_kernel(requested)
    if reason:
        raise ConfigError(f"linear_kernel={requested!r} cannot run here: {reason}", param="linear_kernel")
    return requested


class PackedLinear(nn.Module):
    """y = x W^T + b for 2-D x, W held packed (not readable as a plain matrix).

    kernel: "amx" or "avx512_bf16" for bf16 weights, "avx2" for fp32 ones (a native kernel that
    runs here, see resolve_linear_kernel), or "onednn". Widths the bf16 kernels cannot take
    (in_features % 32) fall back to oneDNN; fp32 weights without their kernel keep torch's linear.
    rows_independent: each output row's bits depend on its input row alone, never on how many
    rows the call has (true of the native kernels; oneDNN picks kernels by row count).
    """

    def __init__(self, linear: nn.Linear, kernel: str = "onednn") -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = weight.dtype
        fits = weight.dtype == torch.float32 or weight.shape[1] % 32 == 0
        native_ok = kernel in linear_kernels_for(weight.dtype) and fits
        self._library = native.load() if native_ok else None
        self.kernel = kernel if self._library is not None else "onednn"
        self.rows_independent = self._library is not None
        if self._library is not None:
            self.kernel_bit = NATIVE_LINEAR_KERNELS[self.kernel][0]  # the fused decode step passes it on
            packed = self._pack(weight.contiguous())
            # Both entry points take the same arguments after the bf16 one's kernel id.
            if self.dtype == torch.float32:
                self._run = self._library.radixkv_packed_linear_f32
            else:
                self._run = functools.partial(self._library.radixkv_packed_linear, self.kernel_bit)
        elif weight.dtype == torch.bfloat16:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        else:
            packed = weight  # torch's own linear
        self.packed_weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        # The kernel adds the bias in fp32 before rounding the sum once.
        self.bias_f32 = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def _pack(self, weight: Tensor) -> Tensor:
        library, (n, k) = self._library, weight.shape
        if self.dtype == torch.float32:
            packed = torch.empty(library.radixkv_packed_floats_f32(n, k), dtype=torch.float32)
            library.radixkv_pack_weight_f32(weight.data_ptr(), n, k, packed.data_ptr())
        else:
            packed = torch.empty(library.radixkv_packed_words(n, k), dtype=torch.bfloat16)
            library.radixkv_pack_weight(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def forward(self, x: Tensor) -> Tensor:
        if self._library is None:
            if self.dtype != torch.bfloat16:
                return torch.nn.functional.linear(x, self.packed_weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.in_features:
            expected = str(self.dtype).removeprefix("torch.")
            raise ValueError(f"expected {expected} input [rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        bias = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        status = self._run(
            x.data_ptr(), x.stride(0), x.shape[0], self.in_features, self.packed_weight.data_ptr(),
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
