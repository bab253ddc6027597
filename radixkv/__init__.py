"""radixkv: an LLM serving runtime where prompts that share a prefix share its KV cache.

The public face: `LLM` to generate in process, `SamplingParams`, `RequestOutput`, `EngineConfig`.
"""

from __future__ import annotations

from radixkv.config import EngineConfig
from radixkv.errors import ConfigError, InvalidRequest, QueueFull
from radixkv.engine.request_output import CompletionOutput, RequestOutput, TokenLogprob
from radixkv.engine.sampling_params import GrammarGuide, JsonGuide, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "GrammarGuide",
    "JsonGuide",
    "TokenLogprob",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "ConfigError",
    "InvalidRequest",
    "QueueFull",
]


def __getattr__(name: str):  # LLM pulls in torch and transformers; import it only when asked
    if name == "LLM":
        from radixkv.llm import LLM

        return LLM
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
