"""The fused CPU decode step installed over a model's decoder layers: decode-only steps run every
layer in one native call (radixkv.cpu.fused_decode) where the step's attention state hands out
tables it checked (StepState.decode_tables); every other step runs the layers module by module.

The loader installs it, as it packs linears; the model and the engine never ask which runs.
Batch invariance holds either way: the fused step calls the kernels the modules call, and runs
an experts layer's MLP (Qwen3-MoE's SparseMoE) through the module itself between its calls.
"""

from __future__ import annotations

from torch import Tensor

from radixkv.attention.base import AttentionMetadata
from radixkv.cpu.fused_decode import FusedDecode
from radixkv.model.llama import CausalLM, DecoderLayers
from radixkv.model.moe import MoEConfig


class FusedDecodeLayers(DecoderLayers):
    """The same layers (same modules, same parameter names) with the fused decode step in front."""

    def __init__(self, layers: DecoderLayers, fused: FusedDecode) -> None:
        super().__init__(layers)
        # None runs every step module by module (a profiler or test compares the two paths).
        self.fused: FusedDecode | None = fused

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, k_caches: list[Tensor], v_caches: list[Tensor],
        k_scales: list[Tensor] | None = None, v_scales: list[Tensor] | None = None,
        local_rope: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        # Pages in another dtype than the compute dtype that the fused step does not read (it
        # reads bf16 and int8 pages under fp32, int8 under bf16) take the layer loop, whose
        # backend widens them.
        if self.fused is None or not self.fused.takes_pages(x.dtype, k_caches[0]):
            return super().forward(x, cos, sin, meta, k_caches, v_caches, k_scales, v_scales, local_rope)
        # One new token per request: a request with none this step has no row to decode. A model
        # with layer groups hands its window layers their own group's checked tables.
        decode_only = meta.is_decode_only and meta.num_seqs == x.shape[0]
        tables = meta.state.decode_tables() if decode_only else None
        window_meta = meta.window_meta
        window_tables = window_meta.state.decode_tables() if tables is not None and window_meta is not None else None
        if tables is None or (window_meta is not None and window_tables is None):
            return super().forward(x, cos, sin, meta, k_caches, v_caches, k_scales, v_scales, local_rope)
        mlp = lambda i, h: self[i].mlp(h, meta)  # noqa: E731  (experts layers: the module, its bits)
        return self.fused.run(x, cos, sin, k_caches, v_caches, tables, k_scales, v_scales, window_tables, local_rope, mlp)


def install_fused_decode(model: CausalLM, split_rows: str = "auto") -> bool:
    """Put the fused decode step in front of the model's layers where every layer can take the
    native path (FusedDecode.for_model); returns whether it did. split_rows: how its threads
    share a step (EngineConfig.split_decode_rows)."""
    moe = model.config.moe
    if moe is not None and not isinstance(moe, MoEConfig):  # gpt-oss's experts: their own layer too
        return False
    fused = FusedDecode.for_model(model)
    if fused is None:
        return False
    fused.split_rows = split_rows
    model.layers = FusedDecodeLayers(model.layers, fused)
    return True


def fused_decode(model: CausalLM) -> FusedDecode | None:
    """The fused step installed over this model's layers and switched on, else None."""
    return model.layers.fused if isinstance(model.layers, FusedDecodeLayers) else None
