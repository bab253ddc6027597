"""Models: loading (default SmolLM2 GGUF, Hugging Face folders, GGUF files, the converted-weights
cache), dtype/device resolution, and the Llama-family forward over a flat batch of tokens."""

from __future__ import annotations

from radixkv.model.device import cpu_has_native_bf16, resolve_device, resolve_dtype
from radixkv.model.llama import SUPPORTED_ARCHITECTURES, CausalLM, ModelConfig, UnsupportedModel
from radixkv.model.loader import LoadedModel, ModelNotFound, default_model_gguf, load_model, load_model_config, load_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelNotFound",
    "UnsupportedModel",
    "cpu_has_native_bf16",
    "default_model_gguf",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
]
