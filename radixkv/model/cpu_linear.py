"""Linear layers whose bf16 weights are prepacked once into oneDNN's blocked layout, for CPU.

F.linear hands oneDNN a plain weight, which it re-lays out on every call; at decode's few rows
that costs more than the product itself. Packed once at load, decode GEMMs run ~1.5x faster.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The row count oneDNN tunes the packed layout for: a decode step's batch, where it matters most.
PACK_FOR_ROWS = 32


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """y = x W^T + b for 2-D x, W held in oneDNN's layout (not readable as a plain matrix)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_FOR_ROWS)
        self.packed_weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in model by a PackedLinear; returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
