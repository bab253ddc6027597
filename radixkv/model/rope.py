"""Rotary position embeddings as transformers computes them: the inverse frequencies of each
RoPE type (default, linear, dynamic, llama3, yarn) and the per-step cos/sin."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from radixkv.errors import UnsupportedModel

if TYPE_CHECKING:
    from radixkv.model.llama import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim/2] in fp32 and the cos/sin scale, as transformers computes them."""
    dim, params = config.head_dim, config.rope_scaling or {}
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = config.rope_type
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK only changes the base past max_position_embeddings, which the engine never reaches.
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, params)
    raise UnsupportedModel(f"rope type {rope_type!r} is not supported; radixkv implements {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: Tensor, params: Mapping[str, Any]) -> Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig, params: Mapping[str, Any]) -> tuple[Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class RotaryEmbedding:
    """cos/sin for each token's position, computed per step in fp32 like transformers.

    A plain object rather than a module with a buffer, so model.to(dtype) never rounds the
    frequencies; they follow the positions' device on first use.
    """

    def __init__(self, config: ModelConfig) -> None:
        with torch.device("cpu"):  # real numbers even when the model is built on the meta device
            self.inv_freq, self.scale = rope_inv_freq(config)

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq  # [T, D/2]
        cos, sin = (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        # sin with the rotate-half sign folded in (see apply_rope), once per step for all layers.
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
