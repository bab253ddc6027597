"""Tiny randomly initialised Hugging Face models with a small trained byte-level tokenizer.

They are saved as ordinary model folders so tests exercise the real loading path, and are
small enough that transformers' own `generate` runs in a blink as the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Question: what is the capital of France? Answer: Paris.",
    "def add(a, b):\n    return a + b\n",
    "Prefix caching shares the KV cache of prompts with a common prefix.",
]
# The tiny tokenizer has none; real chat models bring their own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


# Every tiny config's shape (gemma3_config's too), token id 0 the end, padding and start.
TINY_SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=0,
)


def tiny_config(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(TINY_SHAPE, num_hidden_layers=2)
    common.update(overrides)
    if arch == "gemma3":
        return gemma3_config(**overrides)
    if arch == "gpt_oss":
        return gpt_oss_config(**overrides)
    config_class = {
        "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig, "qwen3_moe": Qwen3MoeConfig,
    }[arch]  # fmt: skip
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 16)
    if arch == "qwen3_moe":  # 8 experts of 32, 2 routed a token, renormalized (Qwen3-30B-A3B's routing)
        for key, value in dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True).items():
            common.setdefault(key, value)
    return config_class(**common)


def gemma3_config(**overrides):
    """A Gemma 3 text model at test size: an 8-token window on 3 of every 4 layers (the real
    model: 512 or 1024 tokens, 5 of every 6), its two RoPE bases, and a final logit softcap so
    that option runs too (Gemma 3's own checkpoints set none)."""
    from transformers import Gemma3TextConfig

    options = dict(
        TINY_SHAPE,
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=24,  # not head_dim, so the scale is the config's
        sliding_window=8,
        sliding_window_pattern=4,
        final_logit_softcapping=30.0,
    )
    options.update(overrides)
    config = Gemma3TextConfig(**options)
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def init_gpt_oss_param(name: str, param: torch.nn.Parameter) -> None:
    """Every weight random; sinks wide (around the scores' size) so a backend that drops them
    answers otherwise (tests/model/test_gpt_oss.py: test_sinks_and_windows_matter)."""
    if "norm" in name:
        param.copy_(1.0 + 0.2 * torch.randn_like(param))
    elif "sinks" in name:
        param.normal_(0.0, 2.0)
    elif param.dim() == 1 or name.endswith("_bias"):
        param.normal_(0.0, 0.2)
    else:
        param.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.15)


def gpt_oss_config(**overrides):
    """gpt-oss at test size: 8-token windows alternating with full layers (the real model: 128),
    8 experts of 32 with 2 routed a token, YaRN RoPE scaled 8x over 64 positions."""
    from transformers import GptOssConfig

    options = dict(
        TINY_SHAPE,
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64,
        ),
    )  # fmt: skip
    options.update(overrides)
    config = GptOssConfig(**options)
    config.architectures = ["GptOssForCausalLM"]
    return config


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random tiny model of `arch` plus tokenizer into `path`; returns the folder."""

    # Random init at 0.02 std gives near-uniform logits and frequent argmax ties; a larger
    # scale makes greedy decoding decisive, so exactness tests compare real choices.
    def init(name: str, param: torch.nn.Parameter) -> None:
        if param.dim() > 1:
            param.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
        if arch == "gemma3":  # tied and scaled by sqrt(hidden): a wide embedding repeats one token
            param.normal_(0.0, 0.02 if "embed" in name else 0.2)  # norms too: (1 + w) starts at w = 0

    return save_random_model(path, arch, seed, init, **overrides)


def save_random_model(
    path: Path, arch: str, seed: int, init: Callable[[str, torch.nn.Parameter], None], **overrides
) -> Path:
    """A tiny `arch` model (tiny_config) whose parameters init(name, param) sets, in order after
    seeding torch with seed, saved with the tiny tokenizer into path; returns the folder."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            init(name, param)
    model.save_pretrained(path)
    tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path
