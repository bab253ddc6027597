"""The OpenAI wire format the server speaks: request bodies, responses, stream chunks, errors.

Request models accept (and ignore) fields they do not know, as OpenAI clients send extras;
fields for features radixkv lacks are accepted only at their no-op values (`unsupported`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROLES = ("system", "developer", "user", "assistant")


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Partitions the prefix cache within the caller's tenant (vLLM's field of the same name).
    cache_salt: str | None = Field(default=None, max_length=1024)
    # Features radixkv does not implement; accepted only when they ask for nothing.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """The name of a field that asks for something radixkv cannot do, if any."""
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.presence_penalty:
            return "presence_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return super().unsupported()

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.logprobs:
            return "logprobs"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string, a token list, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]



class PinRequest(BaseModel):
    """radixkv's own POST /v1/cache/pin: a prefix as text, token ids, or chat messages (rendered
    without the generation prompt, as the beginning of a longer conversation)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = Field(default=None, max_length=1024)


# -- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(BaseModel):
    """Both the whole response and each stream chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixkv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PinResponse(BaseModel):
    object: Literal["cache.pin"] = "cache.pin"
    pin_id: int
    pinned_tokens: int  # the prefix's full pages' worth of tokens now locked
    prompt_tokens: int


class UnpinResponse(BaseModel):
    object: Literal["cache.pin"] = "cache.pin"
    pin_id: int
    deleted: bool = True


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
