"""The Llama-family forward (Llama, Mistral, Qwen2, Qwen3, Gemma 3) over one flat batch of tokens.

gpt-fast style: a config record, RMSNorm, RoPE, attention, MLP, decoder layer, model. Attention
itself is the backend's; this file only projects q/k/v and hands them over with the page caches.
Gemma 3 is the same forward with options: a scaled embedding, (1 + w) norms around each block,
GeGLU, a sliding window and its own RoPE base on local layers, a softcap on the logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from radixkv.attention.base import AttentionBackend, AttentionMetadata
from radixkv.errors import UnsupportedModel
from radixkv.model.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding
from radixkv.model.row_ops import add_rms_norm, apply_rope, gelu_mul, gemma_norm, project_rows, rms_norm, silu_mul

if TYPE_CHECKING:
    from radixkv.model.gpt_oss import GptOssMoEConfig
    from radixkv.model.moe import MoEConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
    "GptOssForCausalLM",
)  # fmt: skip
# Architectures whose MLPs are (partly) routed experts (radixkv.model.moe).
_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

# Configs converted from GGUF (and some old ones) carry no `architectures`; model_type names it.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# Weights some checkpoints carry that the forward recomputes.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # transformers' rope_parameters when not the default rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (always on Qwen2)
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias; not Qwen2)
    moe: MoEConfig | GptOssMoEConfig | None = None  # routed experts (Qwen3-MoE, gpt-oss): their shape and layers
    # Gemma 3's options (the defaults are Llama's).
    hidden_act: str = "silu"  # or "gelu_tanh": GeGLU with the tanh approximation
    gemma_norms: bool = False  # RMSNorm times (1 + w) in fp32; norms after attention and MLP too
    embed_scale: float | None = None  # embeddings times this (sqrt(hidden_size)) in the model dtype
    attention_scale: float | None = None  # q.k scale when not head_dim ** -0.5 (query_pre_attn_scalar)
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window W, None: every key
    local_rope_theta: float | None = None  # RoPE base of the window layers (default rope) when set
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attention_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config; raise UnsupportedModel for anything this forward can't run."""
        architecture = _architecture(hf_config)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {architecture!r} is not supported; radixkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture == "Gemma3ForCausalLM":
            return _gemma3_config(hf_config)
        if architecture == "GptOssForCausalLM":
            from radixkv.model.gpt_oss import gpt_oss_config

            return gpt_oss_config(hf_config)
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"{architecture} with hidden_act={hf_config.hidden_act!r}: only 'silu' is supported")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModel(f"{architecture} with mlp_bias=True is not supported")
        num_q_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_q_heads
        if num_q_heads % num_kv_heads:
            raise UnsupportedModel(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_q_heads
        rope_theta, rope_scaling = _rope_parameters(hf_config)
        bias_flag = bool(getattr(hf_config, "attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        moe = None
        if architecture in _MOE_ARCHITECTURES:
            from radixkv.model.moe import MoEConfig

            moe = MoEConfig.from_hf(hf_config, hf_config.num_hidden_layers)
        return cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_exact_positions(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=is_qwen2 or bias_flag,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=_as_ids(getattr(hf_config, "eos_token_id", None)),
            attention_out_bias=bias_flag and not is_qwen2,
            moe=moe,
        )


def _gemma3_config(hf_config: Any) -> ModelConfig:
    """Gemma 3's text model: Llama's fields from the same config, then its own options."""
    if getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModel(f"Gemma3 with hidden_activation={hf_config.hidden_activation!r} is not supported")
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModel("Gemma3 with attn_logit_softcapping is not supported (no Gemma 3 checkpoint sets it)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModel("Gemma3 with use_bidirectional_attention is not supported")
    layer_types = list(hf_config.layer_types)
    params = getattr(hf_config, "rope_parameters", None) or {}
    global_rope, local_rope = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if local_rope.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"Gemma3 local layers with rope type {local_rope['rope_type']!r} are not supported")

    class GlobalLayers:  # the config as _rope_parameters reads it: the global layers' rope
        rope_parameters = global_rope
        max_position_embeddings = hf_config.max_position_embeddings
        rope_theta = getattr(hf_config, "rope_theta", 1_000_000.0)

    rope_theta, rope_scaling = _rope_parameters(GlobalLayers)
    window = hf_config.sliding_window
    head_dim = hf_config.head_dim
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_q_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=True,
        eos_token_ids=_as_ids(getattr(hf_config, "eos_token_id", None)),
        attention_out_bias=bool(getattr(hf_config, "attention_bias", False)),
        hidden_act="gelu_tanh",
        gemma_norms=True,
        embed_scale=hf_config.hidden_size**0.5,
        attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        layer_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
        local_rope_theta=float(local_rope.get("rope_theta", getattr(hf_config, "rope_local_base_freq", 10_000.0))),
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
    )


# Other names configs give the same forward (a converted GGUF's Gemma 3 names its text model).
_ARCH_ALIASES = {"Gemma3TextForCausalLM": "Gemma3ForCausalLM"}


def _architecture(hf_config: Any) -> str:
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        return _ARCH_ALIASES.get(architectures[0], architectures[0])
    model_type = getattr(hf_config, "model_type", "?")
    return _ARCH_BY_MODEL_TYPE.get(model_type, f"model_type={model_type!r}")


def _rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported; radixkv implements {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return theta, None
    params.update(rope_type=rope_type, rope_theta=theta)
    params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return theta, params


def _max_exact_positions(hf_config: Any) -> int:
    """max_position_embeddings, capped at the sliding window when a layer uses one.

    The forward attends to the whole sequence; with a sliding window that equals the model's
    own attention only while the sequence fits in the window, so the window is the limit.
    """
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    slides = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    return min(limit, window) if slides else limit


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


class RMSNorm(nn.Module):
    """gemma: Gemma's norm, the normalized fp32 rows times (1 + w) in fp32 and only then cast
    (Llama casts first and multiplies by w in the model dtype); one native call on CPU where
    native (the kernel the fused decode step calls), torch ops elsewhere."""

    def __init__(self, dim: int, eps: float, native: bool = True, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.native = native  # the fused add + norm may run as one native call (CPU)
        self.gemma = gemma

    def forward(self, x: Tensor) -> Tensor:
        if self.gemma:
            return gemma_norm(x, self.weight, self.eps, native=self.native)[1]
        return rms_norm(x, self.weight, self.eps, self.native)

    def add_and_normalize(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)): a layer's residual add fused with the next norm."""
        if self.gemma:
            return gemma_norm(x, self.weight, self.eps, delta, self.native)
        return add_rms_norm(x, delta, self.weight, self.eps, native=self.native)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, native: bool = True, layer: int = 0) -> None:
        super().__init__()
        self.num_q_heads, self.num_kv_heads, self.head_dim = config.num_q_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # One matmul for q, k and v: fewer, larger GEMMs are faster on CPU.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, native, gemma=config.gemma_norms)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, native, gemma=config.gemma_norms)
        self.qk_norm = config.qk_norm
        self.backend = backend
        self.native = native  # rope may run as one native call (bf16 on CPU)
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.window = config.window(layer)  # the backend masks keys older than the window
        # gpt-oss: one learned logit per query head joins each softmax's denominator.
        self.sinks = nn.Parameter(torch.zeros(self.num_q_heads)) if config.attention_sinks else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, k_cache: Tensor, v_cache: Tensor,
        k_scales: Tensor | None = None, v_scales: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        num_tokens = x.shape[0]
        qkv = project_rows(self.qkv_proj, x, meta)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = self.q_norm(q.view(num_tokens, self.num_q_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin, self.native), apply_rope(k, cos, sin, self.native)
        else:  # q and k heads side by side: one rotation for both
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_q_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rope(qk, cos, sin, self.native).split([self.num_q_heads, self.num_kv_heads], dim=1)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, k_scales, v_scales, self.window, self.sinks)
        return project_rows(self.o_proj, out.reshape(num_tokens, self.q_size), meta)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, native: bool = True) -> None:
        super().__init__()
        self.native = native  # SiLU * up may run as one native call (bf16 on CPU)
        self.gelu = config.hidden_act == "gelu_tanh"  # GeGLU (Gemma) in place of SwiGLU
        # gate and up fused into one matmul, split after.
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        gate_up = project_rows(self.gate_up_proj, x, meta)
        if self.gelu:
            return project_rows(self.down_proj, gelu_mul(gate_up, self.native), meta)
        return project_rows(self.down_proj, silu_mul(gate_up, self.native), meta)


class DecoderLayer(nn.Module):
    """Llama's layer: input norm, attention, post_attention_layernorm (the MLP's input norm), MLP.
    Gemma's (config.gemma_norms) norms each block's output too, by transformers' names:
    post_attention_layernorm on attention's, pre_ and post_feedforward_layernorm around the MLP."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, native: bool = True, layer: int = 0) -> None:
        super().__init__()
        hidden, eps, gemma = config.hidden_size, config.rms_norm_eps, config.gemma_norms
        self.input_layernorm = RMSNorm(hidden, eps, native, gemma)
        self.self_attn = Attention(config, backend, native, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps, native, gemma)
        if config.moe is not None and layer in config.moe.moe_layers:
            from radixkv.model.gpt_oss import GptOssMoE, GptOssMoEConfig
            from radixkv.model.moe import SparseMoE

            moe = config.moe
            self.mlp: MLP | SparseMoE | GptOssMoE = (
                GptOssMoE(hidden, moe) if isinstance(moe, GptOssMoEConfig) else SparseMoE(hidden, moe, native)
            )
        else:
            self.mlp = MLP(config, native)
        self.gemma = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, native, gemma)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, native, gemma)
        # Window layers rotate by their own RoPE base where the model has one (Gemma's local layers).
        self.local_rope = config.local_rope_theta is not None and self.self_attn.window is not None

    def forward(
        self,
        x: Tensor,
        delta: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        k_cache: Tensor,
        v_cache: Tensor,
        k_scales: Tensor | None = None,
        v_scales: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Takes the residual stream x and the previous layer's MLP output delta (None for the
        first layer), returns the stream and this layer's MLP output: each residual add is
        fused with the norm after it."""
        x, h = self.input_layernorm.add_and_normalize(x, delta)
        attended = self.self_attn(h, cos, sin, meta, k_cache, v_cache, k_scales, v_scales)
        if not self.gemma:
            x, h = self.post_attention_layernorm.add_and_normalize(x, attended)
            return x, self.mlp(h, meta)
        x, h = self.pre_feedforward_layernorm.add_and_normalize(x, self.post_attention_layernorm(attended))
        return x, self.post_feedforward_layernorm(self.mlp(h, meta))


class DecoderLayers(nn.ModuleList):
    """The decoder layers, run one after the other over a step. The loader may swap this list for
    a subclass over the same layers (radixkv.model.fused_layers), as it swaps linears for packed
    ones: the parameters keep their names and the forward its contract."""

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, k_caches: list[Tensor], v_caches: list[Tensor],
        k_scales: list[Tensor] | None = None, v_scales: list[Tensor] | None = None,
        local_rope: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """(residual stream, last layer's MLP output) after every layer. k_scales, v_scales:
        each layer's scales of int8 pages (PagePool.k_scales), None for float pages; local_rope:
        the (cos, sin) of layers with local_rope (Gemma's window layers)."""
        delta = None
        no_scales = [None] * len(k_caches)
        layers = zip(self, k_caches, v_caches, k_scales or no_scales, v_scales or no_scales, strict=True)
        for layer, k_cache, v_cache, k_scale, v_scale in layers:
            layer_cos, layer_sin = local_rope if layer.local_rope and local_rope is not None else (cos, sin)
            layer_meta = meta.for_window(layer.self_attn.window)  # window layers: their group's pages
            x, delta = layer(x, delta, layer_cos, layer_sin, layer_meta, k_cache, v_cache, k_scale, v_scale)
        assert delta is not None, "a model has at least one layer"
        return x, delta


class CausalLM(nn.Module):
    """native_kernels: the layers' row ops may run as native calls (bf16 on CPU); False keeps
    them torch ops (EngineConfig.native_kernels)."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, native_kernels: bool = True) -> None:
        super().__init__()
        if config.attention_sinks and not attention.capabilities.attention_sinks:
            raise UnsupportedModel(
                f"{config.architecture}'s attention sinks do not run on the {attention.name!r} attention backend "
                "(its kernels return no log-sum-exp to rescale by); use attention_backend='cpu' or 'torch'"
            )
        self.config = config
        # Every layer's attention backend; forward prepares its per-step state once.
        self.attention = attention
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(config, attention, native_kernels, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, native_kernels, config.gemma_norms)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config)
        local = config.local_rope_theta
        self.local_rope = None if local is None else RotaryEmbedding(dataclasses.replace(config, rope_theta=local, rope_scaling=None))
        # With layer groups each group's step state is prepared against one of its own layers'
        # caches: the first full layer's and the first window layer's (known once, not per step).
        windowed = [config.window(i) is not None for i in range(config.num_layers)]
        self._first_full_layer = windowed.index(False) if False in windowed else 0
        self._first_window_layer = windowed.index(True) if True in windowed else 0

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        k_caches: list[Tensor],
        v_caches: list[Tensor],
        logits_indices: Tensor,
        k_scales: list[Tensor] | None = None,
        v_scales: list[Tensor] | None = None,
    ) -> Tensor:
        """Logits [B, vocab] in fp32 for the rows logits_indices of a flat batch of T tokens.
        k_scales, v_scales: the pages' scales where they are int8 (PagePool.k_scales)."""
        grouped = meta.window_meta is not None
        self.attention.begin_step(meta, k_caches[self._first_full_layer if grouped else 0], self.config.num_q_heads)
        if grouped:
            self.attention.begin_step(meta.window_meta, k_caches[self._first_window_layer], self.config.num_q_heads)
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.config.embed_scale).to(x.dtype)
        cos, sin = self.rope(positions, x.dtype)
        local_rope = None if self.local_rope is None else self.local_rope(positions, x.dtype)
        x, delta = self.layers(x, cos, sin, meta, k_caches, v_caches, k_scales, v_scales, local_rope)
        # The last add, norm and lm_head only for the rows that are sampled: the vocab
        # projection of every prefill token would cost more than the rest of the forward.
        # Indices rise strictly within the T rows, so T of them are every row in order (a
        # decode step's): no gather then.
        if logits_indices.shape[0] != x.shape[0]:
            x, delta = x[logits_indices], delta[logits_indices]
        _, last = self.norm.add_and_normalize(x, delta)
        logits = project_rows(self.lm_head, last, meta)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_state_dict_hf(self, tensors: Mapping[str, Tensor], modules: Mapping[str, nn.Module] | None = None) -> None:
        """Take weights under transformers' names, fusing q/k/v and gate/up, tying embeddings.

        The model may be built on the meta device: parameters are replaced, not copied into,
        so they take the tensors' dtype and device. modules: modules built elsewhere (quantized
        linears, embedding) by our module name, put in place of ours; their weights are not read
        from tensors. A tied lm_head among them brings its embedding (sharing its weight).
        """
        modules = dict(modules or {})
        sources = self._hf_sources()
        needed = {name for names in sources.values() for name in names}
        available = set(tensors.keys())
        # A module built elsewhere may come from tensors under other names (a GGUF's stacked
        # experts): its own sources need not be there, and tensors under its name are its own.
        provided = tuple(f"model.{name}." for name in modules)
        required = {name for ours, names in sources.items() if ours.rpartition(".")[0] not in modules for name in names}
        missing = sorted(required - available)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s) the model needs, e.g. {missing[:5]}")
        unexpected = sorted(
            name
            for name in available - needed
            if not name.endswith(_IGNORED_WEIGHT_SUFFIXES)
            and not name.startswith(provided)
            and not (name == "lm_head.weight" and self.config.tie_word_embeddings)
        )
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} weight(s) the model does not use, e.g. {unexpected[:5]}"
            )
        state = {}
        for ours, names in sources.items():
            if ours.rpartition(".")[0] in modules:
                continue
            parts = [tensors[name] for name in names]
            state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        tied = self.config.tie_word_embeddings and "lm_head" not in modules
        assert tied or not self.config.tie_word_embeddings or "embed_tokens" in modules, "a tied lm_head comes with its embedding"
        if tied:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        for name, module in modules.items():
            parent, _, child = name.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, child, module)
        left, unused = self.load_state_dict(state, strict=False, assign=True)
        left = [key for key in left if not any(key.startswith(f"{name}.") for name in modules)]
        assert not left and not unused, (left, unused)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    def _hf_sources(self) -> dict[str, list[str]]:
        """Our parameter name -> the transformers names concatenated (dim 0) to make it."""
        config = self.config
        sources = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
        if not config.tie_word_embeddings:
            sources["lm_head.weight"] = ["lm_head.weight"]
        for i in range(config.num_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            attn, mlp = hf + "self_attn.", hf + "mlp."
            norms = ("input", "post_attention", "pre_feedforward", "post_feedforward") if config.gemma_norms else ("input", "post_attention")
            for norm in norms:
                sources[ours + f"{norm}_layernorm.weight"] = [hf + f"{norm}_layernorm.weight"]
            sources[ours + "self_attn.qkv_proj.weight"] = [attn + f"{p}_proj.weight" for p in "qkv"]
            if config.attention_bias:
                sources[ours + "self_attn.qkv_proj.bias"] = [attn + f"{p}_proj.bias" for p in "qkv"]
            sources[ours + "self_attn.o_proj.weight"] = [attn + "o_proj.weight"]
            if config.attention_out_bias:
                sources[ours + "self_attn.o_proj.bias"] = [attn + "o_proj.bias"]
            if config.qk_norm:
                sources[ours + "self_attn.q_norm.weight"] = [attn + "q_norm.weight"]
                sources[ours + "self_attn.k_norm.weight"] = [attn + "k_norm.weight"]
            if config.attention_sinks:
                sources[ours + "self_attn.sinks"] = [attn + "sinks"]
            if config.architecture == "GptOssForCausalLM":
                from radixkv.model import gpt_oss

                sources.update({ours + "mlp." + name: parts for name, parts in gpt_oss.hf_sources(mlp).items()})
                continue
            if config.moe is not None and i in config.moe.moe_layers:
                from radixkv.model.moe import hf_expert_sources

                sources[ours + "mlp.gate.weight"] = [mlp + "gate.weight"]
                for name, parts in hf_expert_sources(mlp, config.moe.num_experts).items():
                    sources[ours + "mlp." + name] = parts
                continue
            sources[ours + "mlp.gate_up_proj.weight"] = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            sources[ours + "mlp.down_proj.weight"] = [mlp + "down_proj.weight"]
        return sources
