"""The radixkv SDK: prompt templates, batch runs, pinned prefixes and forking conversations.

The same calls run in process (pass a `radixkv.LLM`) or against `radixkv serve` (pass an
`openai.OpenAI` client or a base URL); the shared part of the prompts is computed once.

    from radixkv.sdk import PromptTemplate, run_batch, pin, Conversation
"""

from __future__ import annotations

from radixkv.prompts import Prompt
from radixkv.sdk.backends import (
    Backend,
    GenerationError,
    HTTPBackend,
    InProcessBackend,
    Pin,
    Result,
    as_backend,
)
from radixkv.sdk.batch import pin, run_batch, warm
from radixkv.sdk.session import Conversation, Session, generate_all
from radixkv.sdk.template import PromptTemplate, TemplateError, TemplateWarning

__all__ = [
    "Backend",
    "GenerationError",
    "HTTPBackend",
    "InProcessBackend",
    "Pin",
    "Prompt",
    "PromptTemplate",
    "Result",
    "Conversation",
    "Session",
    "TemplateError",
    "TemplateWarning",
    "as_backend",
    "generate_all",
    "pin",
    "run_batch",
    "warm",
]
