"""Which of a model's linears and embedding keep quantized weights (EngineConfig.weight_dtype), and
the QuantLinear/QuantEmbedding modules built for them, one tensor at a time, from a GGUF's blocks
or a float checkpoint's tensors. The loader hands them to CausalLM.load_state_dict_hf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from radixkv.cpu.quant import QuantWeight, quantize_q8_0
from radixkv.cpu.quant_linear import QuantEmbedding, QuantLinear
from radixkv.model.gguf import GGUFFile
from radixkv.cpu.moe import BLOCK_TYPES
from radixkv.model.moe import MappedExperts, QuantExperts

# Our linears (module names end with these), whose weights a weight_dtype may keep quantized.
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
EMBEDDING = "embed_tokens"
LM_HEAD = "lm_head"


class QuantSource:
    """Where quantized weights come from: a GGUF file (its blocks) or float tensors (quantized here).

    weight_dtype "auto": a GGUF's quantized tensors stay in their blocks, every float tensor stays
    float; "int8": every linear becomes q8_0 (a GGUF's Q8_0 blocks as they are)."""

    def __init__(
        self, weight_dtype: str, gguf: GGUFFile | None = None, stored: Callable[[str], Tensor] | None = None
    ) -> None:
        assert weight_dtype in ("auto", "int8") and (gguf is None) != (stored is None)
        self.weight_dtype, self.gguf, self.stored = weight_dtype, gguf, stored

    def is_quantized(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` is to be held quantized."""
        if self.gguf is not None and self.gguf.tensors[name].quantized:
            return True
        return self.weight_dtype == "int8"

    def weight(self, name: str, linear: bool = True) -> QuantWeight:
        """The checkpoint tensor `name` held quantized (linear=False: an untied embedding, kept
        in the file's blocks under int8 too). Converted in slices of rows where it is read."""
        gguf = self.gguf
        if gguf is None:
            return quantize_q8_0(self.stored(name).float())  # one float tensor at a time
        if self.weight_dtype == "auto" or not linear:
            # Q4_K and Q6_K as the file has them: QuantLinear converts them where its kernel lacks them.
            return gguf.quantized(name, super_blocks=True)
        return gguf.quantized(name, requantize=gguf.tensors[name].type_name != "Q8_0")

    def bias(self, name: str) -> Tensor:
        return self.gguf.dequantized(name) if self.gguf is not None else self.stored(name).float()


def quantized_modules(
    sources: Mapping[str, list[str]],
    available: set[str],
    source: QuantSource,
    tied: bool,
    dtype: torch.dtype,
    kernel: str,
    moe_kernel: str = "torch",
) -> dict[str, nn.Module]:
    """Modules by our module name (e.g. layers.0.self_attn.qkv_proj) for every linear whose
    checkpoint tensors are all to be held quantized, and the embedding where its weight is.

    sources: CausalLM._hf_sources() (our parameter -> checkpoint names, concatenated on dim 0).
    A tied lm_head is the embedding's tensor; its QuantEmbedding reads the linear's bytes.
    moe_kernel: a resolved EngineConfig.moe_kernel, for experts read in place (MappedExperts)."""
    modules: dict[str, nn.Module] = {}
    # The embedding first: the largest tensor, while nothing else is held, so the peak is the
    # model plus one of the small tensors being converted, not plus the embedding's conversion.
    embedding = "model.embed_tokens.weight"
    if tied and source.is_quantized(embedding):
        head = QuantLinear(source.weight(embedding), None, kernel)
        modules[LM_HEAD] = head
        modules[EMBEDDING] = QuantEmbedding(head, dtype)
    elif source.gguf is not None and source.gguf.tensors[embedding].quantized:
        # An embedding is no linear: int8 leaves its blocks as the file has them.
        modules[EMBEDDING] = QuantEmbedding(source.weight(embedding, linear=False), dtype)
    modules.update(_expert_modules(sources, source, kernel, moe_kernel))
    for ours, names in sorted(sources.items(), key=lambda item: item[0] != "lm_head.weight"):  # an untied lm_head first
        module, _, kind = ours.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in _LINEARS:
            continue
        if not all(source.is_quantized(name) for name in names):
            continue
        weights = [source.weight(name) for name in names]
        bias_names = [name.removesuffix(".weight") + ".bias" for name in names]
        biases = [source.bias(name) for name in bias_names if name in available]
        assert not biases or len(biases) == len(names), "every part has a bias or none"
        modules[module] = _linear(weights, torch.cat(biases) if biases else None, kernel)
        del weights
        release_freed_heap()  # else each linear's freed temporaries stay resident: ~0.07 GB at a 1B's peak
    return modules


def _expert_modules(sources: Mapping[str, list[str]], source: QuantSource, kernel: str, moe_kernel: str) -> dict[str, nn.Module]:
    """For each expert block whose tensors are all to be held quantized: a MappedExperts over the
    GGUF's stacked blocks in place (weight_dtype "auto", block types csrc/moe.c reads), else a
    QuantExperts (radixkv.model.moe): per expert, one QuantLinear over its gate and up rows and
    one over its down, each converted from that expert's own tensor, one expert at a time."""
    modules: dict[str, nn.Module] = {}
    for ours, gate_up in sources.items():
        module, _, kind = ours.rpartition(".")
        if kind != "gate_up" or module.rpartition(".")[2] != "experts":
            continue
        down = sources[f"{module}.down"]
        if not all(source.is_quantized(name) for name in (*gate_up, *down)):
            continue
        mapped = _mapped_experts(source, f"model.{module}", moe_kernel)
        if mapped is not None:
            modules[module] = mapped
            continue
        pairs = zip(gate_up[0::2], gate_up[1::2], strict=True)
        modules[module] = QuantExperts(
            [_linear([source.weight(gate), source.weight(up)], None, kernel) for gate, up in pairs],
            [_linear([source.weight(name)], None, kernel) for name in down],
        )
    return modules


def _mapped_experts(source: QuantSource, prefix: str, moe_kernel: str) -> MappedExperts | None:
    """The GGUF's stacked experts of `prefix` (model.layers.N.mlp.experts) read in place, where
    weight_dtype is "auto" and every part is a block type the grouped kernel reads."""
    gguf = source.gguf
    if gguf is None or source.weight_dtype != "auto" or moe_kernel not in ("native", "native_fp32", "torch"):
        return None
    parts = [gguf.stacked.get((prefix, part)) for part in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None or p.type_name not in BLOCK_TYPES for p in parts):
        return None
    gate, _, down = parts
    kernel = "torch" if moe_kernel == "torch" else "native"
    for part in parts:
        gguf.populate(part)
    return MappedExperts([(p.type_name, gguf.mapped(p)) for p in parts], down.shape[1], gate.shape[1], kernel)


def _linear(weights: list[QuantWeight], bias: Tensor | None, kernel: str) -> nn.Module:
    """One QuantLinear over the parts' rows stacked. Parts in different formats (a Q4_K_M file's
    Q4_K q and k beside a Q6_K v) stay in their own formats, as one linear of parts, which the
    fused decode step runs as any other."""
    return QuantLinear(weights, bias, kernel)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: each storage of a parameter or buffer once (tied weights
    count once), and the quantized modules' QuantWeights held outside buffers."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    for module in model.modules():
        # A packed QuantLinear's bytes are its buffer (counted above); an unpacked one's a QuantWeight.
        if isinstance(module, QuantLinear) and module.packed is None:
            total += module.weight_nbytes
        elif isinstance(module, QuantEmbedding):
            total += module.weight_nbytes
    return total


def release_freed_heap() -> None:
    """Hand the heap a quantized load freed (a tensor's file bytes and conversion temporaries,
    freed into the allocator's free lists) back to the OS, where glibc can; the process's RSS
    otherwise keeps them for good (docs/measurements.md)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
