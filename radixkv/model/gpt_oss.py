"""gpt-oss (GptOssForCausalLM) as options of the Llama-family forward (sinks, biases, YaRN, windows):
its config, its expert block (router with a bias, softmax over the top-k, clamped SwiGLU), float or MXFP4 experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from radixkv.attention.base import AttentionMetadata
from radixkv.cpu.mxfp4 import native_mxfp4
from radixkv.errors import UnsupportedModel
from radixkv.model.moe import ExpertGroups, combine_by_expert, group_by_expert
from radixkv.model.row_ops import project_rows

if TYPE_CHECKING:
    from radixkv.model.gguf import GGUFFile
    from radixkv.model.llama import ModelConfig


@dataclass(slots=True, frozen=True)
class GptOssMoEConfig:
    """gpt-oss's experts: every layer's MLP is the expert block."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    intermediate_size: int  # each expert's gated width
    swiglu_alpha: float  # glu = gate * sigmoid(alpha * gate)
    swiglu_limit: float  # gate clamped above, up clamped both ways, at this
    moe_layers: tuple[int, ...]


def gpt_oss_config(hf_config: Any) -> ModelConfig:
    """transformers' GptOssConfig as ModelConfig: biases on q/k/v/o, a sink per query head,
    windows on the `sliding_attention` layers, YaRN RoPE, experts on every layer."""
    from radixkv.model.llama import ModelConfig, _as_ids, _rope_parameters

    num_layers = int(hf_config.num_hidden_layers)
    layer_types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers)
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedModel(f"GptOssForCausalLM with layer types {unknown}: only sliding_attention and full_attention run")
    window = getattr(hf_config, "sliding_window", None)
    rope_theta, rope_scaling = _rope_parameters(hf_config)
    num_q_heads = int(hf_config.num_attention_heads)
    moe = GptOssMoEConfig(
        num_experts=int(hf_config.num_local_experts),
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        intermediate_size=int(hf_config.intermediate_size),
        swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
        swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)),
        moe_layers=tuple(range(num_layers)),
    )
    bias = bool(getattr(hf_config, "attention_bias", True))
    return ModelConfig(
        architecture="GptOssForCausalLM",
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=num_layers,
        num_q_heads=num_q_heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_q_heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_q_heads),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=False,
        eos_token_ids=_as_ids(getattr(hf_config, "eos_token_id", None)),
        attention_out_bias=bias,
        moe=moe,
        layer_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
        attention_sinks=True,
    )


def hf_sources(prefix: str) -> dict[str, list[str]]:
    """Our expert block's parameters -> transformers' names, for a layer's `mlp.` prefix."""
    names = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
    return {"router.weight": [prefix + "router.weight"], "router.bias": [prefix + "router.bias"]} | {
        name: [prefix + name] for name in names
    }


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's gated activation: (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate clamped above."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FloatGptOssExperts(nn.Module):
    """The experts as transformers stores them: gate_up_proj [E, H, 2I] with gate and up
    interleaved by column, down_proj [E, I, H], a bias for each; x @ W + b as transformers computes."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def gate_up(self, expert: int, x: Tensor) -> tuple[Tensor, Tensor]:
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        return gate_up[..., ::2], gate_up[..., 1::2]

    def down(self, expert: int, h: Tensor) -> Tensor:
        return h @ self.down_proj[expert] + self.down_proj_bias[expert]


class MappedMxfp4Experts(nn.Module):
    """A GGUF's stacked experts read in place (a memory map of the file: its own blocks, never
    copied); the biases are floats. MXFP4 experts (gpt-oss's files) under kernel "native" run
    grouped through csrc/moe_mxfp4.c (radixkv.cpu.mxfp4), each routed expert's rows read once a
    step; otherwise (kernel "torch", or another block type) each routed expert's rows are
    dequantized to fp32 by torch for its tokens of the step.

    parts: (gate, up, down) as (block type, uint8 view [experts, rows, row bytes])."""

    rows_independent = True

    def __init__(self, parts: Sequence[tuple[str, np.ndarray]], biases: Sequence[Tensor], hidden_size: int,
                 intermediate_size: int, kernel: str = "torch") -> None:  # fmt: skip
        super().__init__()
        assert len(parts) == 3 and len(biases) == 3
        (self.gate_type, self.gate_blocks), (self.up_type, self.up_blocks), (self.down_type, self.down_blocks) = parts
        self.gate_bias, self.up_bias, self.down_bias = (nn.Parameter(b, requires_grad=False) for b in biases)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.grouped_ready = kernel == "native" and all(part[0] == "MXFP4" for part in parts)
        self.mxfp4_kernel: str | None = None  # the kernel's path (radixkv.cpu.mxfp4.KERNELS), None: the fastest here

    def grouped(self, x: Tensor, groups: ExpertGroups, alpha: float, limit: float) -> Tensor:
        """Every routed pair's expert output [pairs, H] in x's dtype, in groups' order: gate and
        up (with their biases) in fp32, cast to x's dtype, the clamped SwiGLU, down with its bias,
        as gate_up and down compute them, each projection one native call."""
        size, pairs = self.intermediate_size, groups.tokens.numel()
        ids, offsets = torch.tensor(groups.experts, dtype=torch.int32), torch.tensor(groups.offsets, dtype=torch.int32)
        x32, tokens = x.float().contiguous(), groups.tokens.to(torch.int32)
        gate_up = torch.empty(pairs, 2 * size)
        for at, blocks, bias in ((0, self.gate_blocks, self.gate_bias), (size, self.up_blocks, self.up_bias)):
            native_mxfp4(blocks, x32, ids, offsets, tokens, gate_up[:, at : at + size], _f32(bias), self.mxfp4_kernel)
        gate, up = gate_up.to(x.dtype).split(size, dim=1)
        h = clamped_swiglu(gate, up, alpha, limit).float().contiguous()
        y = torch.empty(pairs, self.hidden_size)
        order = torch.arange(pairs, dtype=torch.int32)
        native_mxfp4(self.down_blocks, h, ids, offsets, order, y, _f32(self.down_bias), self.mxfp4_kernel)
        return y.to(x.dtype)

    @property
    def mapped_bytes(self) -> int:
        return self.gate_blocks.nbytes + self.up_blocks.nbytes + self.down_blocks.nbytes

    def gate_up(self, expert: int, x: Tensor) -> tuple[Tensor, Tensor]:
        gate = F.linear(x.float(), _rows(self.gate_type, self.gate_blocks[expert], self.hidden_size), self.gate_bias[expert].float())
        up = F.linear(x.float(), _rows(self.up_type, self.up_blocks[expert], self.hidden_size), self.up_bias[expert].float())
        return gate.to(x.dtype), up.to(x.dtype)

    def down(self, expert: int, h: Tensor) -> Tensor:
        w = _rows(self.down_type, self.down_blocks[expert], self.intermediate_size)
        return F.linear(h.float(), w, self.down_bias[expert].float()).to(h.dtype)

    def extra_repr(self) -> str:
        kernel = "native" if self.grouped_ready else "torch"
        return f"types={self.gate_type}/{self.up_type}/{self.down_type}, mapped_bytes={self.mapped_bytes}, kernel={kernel}"


def _f32(bias: Tensor) -> Tensor:
    """A bias as the native kernel reads it (already fp32 in a file's experts: no copy)."""
    return bias.detach().float().contiguous()


def gguf_experts(file: GGUFFile, config: ModelConfig, kernel: str = "torch") -> dict[str, nn.Module]:
    """Every layer's experts read in place from a gpt-oss GGUF (llama.cpp's layout: gate and up
    apart, [experts, rows, inputs], biases [experts, rows]), by our module name; kernel: the
    resolved EngineConfig.moe_kernel ("native" runs MXFP4 experts through csrc/moe_mxfp4.c)."""
    assert isinstance(config.moe, GptOssMoEConfig)
    modules: dict[str, nn.Module] = {}
    for layer in config.moe.moe_layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        try:
            parts = [file.stacked[(prefix, f"{part}_proj")] for part in ("gate", "up", "down")]
            biases = [file.dequantized(f"{prefix}.{part}_bias") for part in ("gate", "up", "down")]
        except KeyError as exc:
            raise UnsupportedModel(f"{str(file.path)!r} lacks layer {layer}'s stacked experts or their biases ({exc})") from None
        for part in parts:  # mapped now, as llama.cpp does, not faulted in on a step's first touch
            file.populate(part)
        modules[f"layers.{layer}.mlp.experts"] = MappedMxfp4Experts(
            [(part.type_name, file.mapped(part)) for part in parts], biases, config.hidden_size, config.moe.intermediate_size,
            "native" if kernel in ("native", "native_fp32") else "torch",
        )
    return modules


def hide_gguf_rope_scaling() -> None:
    """Hide a gpt-oss GGUF's rope.scaling.* fields from gguf-py's reader in this process (the one
    that reads a GGUF's config and tokenizer): transformers' gpt-oss GGUF config reader takes such
    a field's first part (its key's length) for its value and fails on it. `gguf_rope` then sets
    the RoPE from the header's numbers."""
    import gguf

    base = gguf.GGUFReader
    if getattr(base, "hides_rope_scaling", False):
        return

    class Reader(base):  # type: ignore[misc, valid-type]
        hides_rope_scaling = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for key in [key for key in self.fields if key.startswith("gpt-oss.rope.scaling.")]:
                del self.fields[key]

    gguf.GGUFReader = Reader


def gguf_rope(rope: dict[str, Any], scalars: dict[str, int | float | bool]) -> dict[str, Any]:
    """A converted config's rope_parameters (GptOssConfig's default YaRN) with the GGUF's base,
    factor and original context; llama.cpp's gpt-oss files are YaRN, so the type is kept."""
    keys = {"rope_theta": "gpt-oss.rope.freq_base", "factor": "gpt-oss.rope.scaling.factor",
            "original_max_position_embeddings": "gpt-oss.rope.scaling.original_context_length"}  # fmt: skip
    return {**rope, **{field: scalars[key] for field, key in keys.items() if key in scalars}}


def _rows(type_name: str, blocks: np.ndarray, width: int) -> Tensor:
    """One expert's [rows, row bytes] blocks as fp32 [rows, width]."""
    from radixkv.model.gguf import dequantize_rows

    return dequantize_rows(type_name, blocks, width)


class GptOssMoE(nn.Module):
    """gpt-oss's MLP: router logits (with a bias), top-k of the logits, softmax over those k,
    each routed expert run once on its tokens and scatter-added in ascending expert order."""

    def __init__(self, hidden_size: int, moe: GptOssMoEConfig) -> None:
        super().__init__()
        self.top_k, self.alpha, self.limit = moe.num_experts_per_tok, moe.swiglu_alpha, moe.swiglu_limit
        self.router = nn.Linear(hidden_size, moe.num_experts, bias=True)
        self.experts: FloatGptOssExperts | MappedMxfp4Experts = FloatGptOssExperts(
            moe.num_experts, hidden_size, moe.intermediate_size
        )

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        logits = project_rows(self.router, x, meta)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        groups = group_by_expert(ids, weights)
        if getattr(self.experts, "grouped_ready", False):
            # Pairs scatter-added in expert order per token, as combine_by_expert adds them, into
            # fp32: torch's bf16 index_add_ on CPU runs a slow path (milliseconds for a few rows),
            # so bf16 terms are summed in fp32 and rounded once (fp32 models: the same bits).
            y = (self.experts.grouped(x, groups, self.alpha, self.limit) * groups.weights[:, None]).to(x.dtype)
            return torch.zeros(x.shape).index_add_(0, groups.tokens, y.float()).to(x.dtype)
        split = meta.batch_invariant and not getattr(self.experts, "rows_independent", False)
        return combine_by_expert(x, groups, self._expert, split)

    def _expert(self, expert: int, x: Tensor) -> Tensor:
        gate, up = self.experts.gate_up(expert, x)
        return self.experts.down(expert, clamped_swiglu(gate, up, self.alpha, self.limit))
