"""Tiny GGUF files for tests: a random Llama (tests.helpers.tiny_models' config and init, widened to
K-quant rows of 256) written with gguf.GGUFWriter in one weight type, with the default SmolLM2
GGUF's tokenizer metadata copied over so transformers builds its tokenizer and reads the file too:
its first VOCAB tokens and the merges that make them (a whole 49k vocabulary takes transformers
a minute to convert, for each file).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.tiny_models import init_gpt_oss_param, tiny_config

# Quantized with gguf.quants.quantize; the K-quants are written as random valid blocks.
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1")
RANDOM_BLOCK_TYPES = ("Q4_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16")
ALL_TYPES = (*FLOAT_TYPES, *QUANTIZED_TYPES, *RANDOM_BLOCK_TYPES)
# llama.cpp's Q4_K_M mix: attn_v and ffn_down in Q6_K, the other matrices in Q4_K, so q/k/v (and
# a fused linear) hold two formats.
MIXES = {"Q4_K_M": {"attn_v": "Q6_K", "ffn_down": "Q6_K"}}
# Tokens kept of the copied tokenizer: its 17 special tokens, 256 bytes, then one per merge.
VOCAB = 1024
_FIRST_MERGED = 273
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


@functools.cache
def _tokenizer_fields() -> tuple[tuple[str, object, object, object], ...]:
    """(key, value, type, item type) of every tokenizer.* field of the default SmolLM2 GGUF,
    its vocabulary cut to VOCAB tokens: merge i makes token 273 + i, so the first merges are kept."""
    from gguf import GGUFReader, GGUFValueType

    from radixkv.model.loader import default_model_gguf

    reader = GGUFReader(default_model_gguf())
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            value = field.contents()
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                value = value[:VOCAB]
            elif key == "tokenizer.ggml.merges":
                value = value[: VOCAB - _FIRST_MERGED]
            fields.append((key, value, kind, sub))
    return tuple(fields)


def _llama_state(seed: int, tied: bool) -> tuple[object, dict[str, np.ndarray]]:
    """A tiny random Llama's config and fp32 weights under transformers' names."""
    torch.manual_seed(seed)
    config = tiny_config("llama", vocab_size=VOCAB, tie_word_embeddings=tied, max_position_embeddings=512, **SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make_tiny_model's scales: decisive greedy choices
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.dim() > 1:
                param.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
    state = {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return config, state


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (radixkv.model.gguf undoes it)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random K-quant blocks [rows, bytes per row]: random quants and sub-block scales,
    super-block scales small positive fp16 (weights around +-0.1)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if type_name == "Q4_K":  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of nibbles
        blocks[..., 0:2] = _f16_bytes(rng.uniform(0.002, 0.004, blocks.shape[:2]))
        blocks[..., 2:4] = _f16_bytes(rng.uniform(0.004, 0.008, blocks.shape[:2]))
    elif type_name == "Q6_K":  # 128 bytes low bits, 64 high bits, 16 int8 scales, d (fp16) last
        blocks[..., 192:208] = rng.integers(-32, 32, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = _f16_bytes(rng.uniform(0.0001, 0.0002, blocks.shape[:2]))
    return blocks.reshape(rows, -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _start(writer: Any, name: str, config: Any) -> Any:
    """writer with its name and shape written (the fields every tiny GGUF here opens with)."""
    writer.add_name(name)
    _write_shape(writer, config)
    return writer


def _add_tokenizer(writer: Any) -> None:
    """The vocabulary size and the tokenizer's fields, the same in every tiny GGUF here."""
    writer.add_vocab_size(VOCAB)
    for key, value, kind, sub in _tokenizer_fields():
        writer.add_key_value(key, value, kind, sub)


def _write_shape(writer: Any, config: Any) -> None:
    """The header fields every tiny GGUF here shares: the transformer's shape, RoPE base, norm eps."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None) else config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _add_tensor(writer: Any, gguf_name: str, weights: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    """weights as a GGUF tensor of type kind: F32 and F16 as they are, the types gguf-py
    quantizes (QUANTIZED_TYPES) quantized, the K-quants as random valid blocks (rows of any
    leading shape, experts stacked included)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind == "F32":
        writer.add_tensor(gguf_name, weights.astype(np.float32))
    elif kind == "F16":
        writer.add_tensor(gguf_name, weights.astype(np.float16))
    elif kind in QUANTIZED_TYPES:
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, quantize(weights, qtype), raw_dtype=qtype)
    else:
        rows = int(np.prod(weights.shape[:-1]))
        blocks = _random_blocks(kind, rows, weights.shape[-1], rng).reshape(*weights.shape[:-1], -1)
        writer.add_tensor(gguf_name, blocks, raw_dtype=GGMLQuantizationType[kind])


def _finish(writer: Any, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(
    path: Path, type_name: str, seed: int = 0, tied: bool = True, overrides: dict[str, str] | None = None
) -> Path:
    """A tiny random Llama GGUF with its matrices in type_name (a type, or a mix of MIXES; norms
    F32), at path. overrides: GGUF tensor name -> type written as random bytes (an unsupported
    type, for the error it must give)."""
    mix = MIXES.get(type_name, {})
    base = "Q4_K" if mix else type_name
    from gguf import GGUFWriter

    config, state = _llama_state(seed, tied)
    writer = _start(GGUFWriter(str(path), "llama"), f"tiny-llama-{type_name}", config)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    _add_tokenizer(writer)
    rng = np.random.default_rng(seed)
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    }  # fmt: skip
    block = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, weights in state.items():
        if name in names:
            gguf_name = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{block[rest.removesuffix('.weight')]}.weight"
        if ".attn_q." in gguf_name:
            weights = _permute(weights, config.num_attention_heads)
        elif ".attn_k." in gguf_name:
            weights = _permute(weights, config.num_key_value_heads)
        kind = (overrides or {}).get(gguf_name) or mix.get(gguf_name.split(".")[-2], base)
        _add_tensor(writer, gguf_name, weights, "F32" if weights.ndim == 1 else kind, rng)
    return _finish(writer, path)


class TinyGGUFs:
    """Tiny GGUF files by weight type, each written on first use (a session fixture holds one)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[tuple[str, bool], Path] = {}

    def __call__(self, type_name: str, tied: bool = True) -> Path:
        key = (type_name, tied)
        if key not in self._files:
            folder = self.folder / f"{type_name}-{'tied' if tied else 'untied'}"
            folder.mkdir(parents=True, exist_ok=True)
            self._files[key] = write_tiny_gguf(folder / f"tiny-{type_name}.gguf", type_name, tied=tied)
        return self._files[key]


# A tiny random Qwen3-MoE in GGUF (llama.cpp's qwen3moe layout): experts stacked in 3-D tensors.
# The experts are 768 wide, Qwen3MoeConfig's default, because transformers' GGUF reader (the
# reference) does not read expert_feed_forward_length; radixkv does (MOE_NARROW checks it).
MOE_SHAPE = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2, norm_topk_prob=True,
)  # fmt: skip
MOE_NARROW = 256
# Q4_K_M's mix as llama.cpp applies it to an MoE: the stacked down experts in Q6_K too.
MOE_MIXES = {"Q4_K_M": {"attn_v": "Q6_K", "ffn_down_exps": "Q6_K"}}


def _qwen3_moe_state(seed: int, moe_intermediate_size: int) -> tuple[object, dict[str, np.ndarray]]:
    """A tiny random Qwen3-MoE's config and fp32 weights under GGUF's names (experts stacked)."""
    from transformers import Qwen3MoeConfig

    torch.manual_seed(seed)
    shape = dict(MOE_SHAPE, moe_intermediate_size=moe_intermediate_size)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, **shape
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.dim() > 1:
                param.normal_(0.0, 0.3 if "embed" in name else 0.15)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    block = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
        "mlp.experts.down_proj": "ffn_down_exps",
    }  # fmt: skip
    state = {}
    for name, tensor in model.state_dict().items():
        values = tensor.detach().numpy().copy()
        if name in names:
            state[names[name]] = values
            continue
        if name == "lm_head.weight":
            continue
        _, _, layer, rest = name.split(".", 3)
        rest = rest.removesuffix(".weight")
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows first
            state[f"blk.{layer}.ffn_gate_exps.weight"] = values[:, :moe_intermediate_size].copy()
            state[f"blk.{layer}.ffn_up_exps.weight"] = values[:, moe_intermediate_size:].copy()
        else:
            state[f"blk.{layer}.{block[rest]}.weight"] = values
    return config, state


def write_tiny_moe_gguf(path: Path, type_name: str, seed: int = 0, moe_intermediate_size: int = 768) -> Path:
    """A tiny random Qwen3-MoE GGUF at path: its matrices in type_name (a type, or a mix of
    MOE_MIXES; norms and the router F32), experts stacked [experts, rows, inputs] as llama.cpp
    stores them; the K-quants written as random valid blocks, the others quantized from weights."""
    from gguf import GGUFWriter

    mix = MOE_MIXES.get(type_name, {})
    base = "Q4_K" if mix else type_name
    config, state = _qwen3_moe_state(seed, moe_intermediate_size)
    writer = _start(GGUFWriter(str(path), "qwen3moe"), f"tiny-qwen3moe-{type_name}", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(moe_intermediate_size)
    _add_tokenizer(writer)
    rng = np.random.default_rng(seed)
    for gguf_name, weights in state.items():
        router = weights.ndim == 1 or ".ffn_gate_inp." in gguf_name
        _add_tensor(writer, gguf_name, weights, "F32" if router else mix.get(gguf_name.split(".")[-2], base), rng)
    return _finish(writer, path)


# A tiny random gpt-oss in GGUF (llama.cpp's gpt-oss layout): gate and up experts apart, stacked
# [experts, rows, inputs] in MXFP4, their biases, the router's and q/k/v/o's biases and the sinks
# in F32; the same model as an HF folder whose experts are the MXFP4 values dequantized.
GPT_OSS_SHAPE = dict(
    hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
    num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
)  # fmt: skip


def write_tiny_gpt_oss_gguf(path: Path, folder: Path, seed: int = 0, matrices: str = "F32") -> Path:
    """The GGUF at path and, in folder, transformers' model with the GGUF's dequantized weights
    (matrices: the type of q/k/v/o, the embedding and the output; Q8_0 is dequantized into the
    folder too)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import dequantize, quantize

    from tests.helpers.tiny_models import gpt_oss_config

    torch.manual_seed(seed)
    config = gpt_oss_config(vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False, **GPT_OSS_SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mx = GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, param in model.named_parameters():
            init_gpt_oss_param(name, param)
        for layer in model.model.layers:  # the experts as MXFP4 holds them: the reference's values
            for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                blocks = quantize(param.transpose(1, 2).contiguous().numpy(), mx)
                values = dequantize(blocks, mx).reshape(param.shape[0], param.shape[2], param.shape[1])
                param.copy_(torch.from_numpy(values).transpose(1, 2))
        if matrices != "F32":  # the other matrices as the file holds them
            qtype = GGMLQuantizationType[matrices]
            for name, param in model.named_parameters():
                if param.dim() == 2 and "router" not in name:
                    param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), qtype), qtype).reshape(param.shape)))
    model.save_pretrained(folder)
    rng = np.random.default_rng(seed)
    width = config.intermediate_size
    writer = _start(GGUFWriter(str(path), "gpt-oss"), "tiny-gpt-oss", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(width)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters  # transformers' GGUF reader misreads these; radixkv reads them itself
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _add_tokenizer(writer)
    block = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
        **{f"self_attn.{p}_proj.{kind}": f"attn_{'output' if p == 'o' else p}.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
    }  # fmt: skip
    for name, tensor in model.state_dict().items():
        values = tensor.detach().numpy().copy()
        globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
        if name in globals_ and name != "model.norm.weight":
            _add_tensor(writer, globals_[name], values, matrices, rng)
            continue
        if name in globals_:
            writer.add_tensor(globals_[name], values)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest in block and rest.endswith("_proj.weight"):
            _add_tensor(writer, f"blk.{layer}.{block[rest]}", values, matrices, rng)
        elif rest in block:
            writer.add_tensor(f"blk.{layer}.{block[rest]}", values)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate and up interleaved by column
            for part, start in (("gate", 0), ("up", 1)):
                stacked = np.ascontiguousarray(values[:, :, start::2].transpose(0, 2, 1))
                writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", quantize(stacked, mx), raw_dtype=mx)
        elif rest == "mlp.experts.gate_up_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(values[:, 0::2]))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(values[:, 1::2]))
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", quantize(np.ascontiguousarray(values.transpose(0, 2, 1)), mx), raw_dtype=mx)
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", values)
        else:
            raise AssertionError(f"no GGUF name for {name}")
    return _finish(writer, path)
