"""The wire format of OpenAI's Responses API (POST /v1/responses): the request body with its
input items, tools and text format, and the Response object, its output items and usage.

Request models ignore fields they do not know (clients send extras such as `include`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from radixkv.server.guards.request_caps import (
    CAPS,
    check_arguments,
    check_schema_or_none,
    max_items,
)
from radixkv.server.openai.protocol import PromptCacheKept, PromptCacheOptions


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- input items -----------------------------------------------------------------------------


class TextContent(_Lenient):
    """A text part of a message; the other kinds (images, files, audio) are refused."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | Annotated[list[TextContent], Field(max_length=CAPS.max_content_blocks)], max_items(CAPS.max_content_blocks, "content parts")]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(max_length=CAPS.max_id_chars)
    name: str = Field(max_length=CAPS.max_tool_name_chars)
    arguments: Annotated[str, AfterValidator(check_arguments)]
    id: str | None = Field(default=None, max_length=CAPS.max_id_chars)


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=CAPS.max_id_chars)
    output: Annotated[str | Annotated[list[TextContent], Field(max_length=CAPS.max_content_blocks)], max_items(CAPS.max_content_blocks, "content parts")]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningPart(_Lenient):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Lenient):
    """A reply's reasoning handed back, as the Agents SDK sends the items it was given; its
    text goes to the assistant turn after it (responses_convert.conversation)."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=CAPS.max_id_chars)
    summary: Annotated[list[ReasoningPart], Field(max_length=CAPS.max_content_blocks), max_items(CAPS.max_content_blocks, "summary parts")] = Field(default_factory=list)
    content: Annotated[Annotated[list[ReasoningPart], Field(max_length=CAPS.max_content_blocks)] | None, max_items(CAPS.max_content_blocks, "content parts")] = None

    def text(self) -> str:
        """The reasoning itself where the item carries it, else its summary."""
        if self.content:
            return "".join(part.text for part in self.content)
        return "\n\n".join(part.text for part in self.summary)


INPUT_ITEMS: dict[str, type[_Lenient]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# -- tools and formats -----------------------------------------------------------------------


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=CAPS.max_tool_name_chars)
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(check_schema_or_none)] = None
    strict: bool | None = None


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    name: str = Field(max_length=CAPS.max_tool_name_chars)


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=CAPS.max_tool_name_chars)
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, AfterValidator(check_schema_or_none)] = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    # Items are checked one by one (responses_convert.input_items), so an error names the item.
    input: Annotated[str | Annotated[list[dict[str, Any]], Field(max_length=CAPS.max_messages)], max_items(CAPS.max_messages, "input items")]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=CAPS.max_tools), max_items(CAPS.max_tools, "tools")] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=CAPS.max_id_chars)
    stream: bool = False
    # OpenAI's caps: 16 pairs, keys of 64 characters, values of 512 (stored and echoed back).
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = None  # names a session (server/sessions.py); partitions nothing
    prompt_cache_options: PromptCacheOptions | None = None  # server/openai/prompt_cache.py
    # As on chat: the whole prompt kept for the named time (server/keeps.py retention).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # radixkv's own: partitions the prefix cache within the caller's tenant, as on chat.
    cache_salt: str | None = Field(default=None, max_length=1024)
    # vLLM's name, as on chat: the reply held to a regular expression (a plain answer's shape,
    # like text.format; a forced tool call's schema wins). As many characters as chat takes.
    guided_regex: str | None = Field(default=None, min_length=1, max_length=128 << 10)
    seed: int | None = None  # as on chat (radixkv's, like vLLM's): a sampled reply made repeatable
    # radixkv's own, as on chat: the response carries its cache report (server/cache_report.py).
    cache_report: bool = False

    def choice(self) -> str:
        """tool_choice in tools.py's terms: none, auto, required or a function's name."""
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.name


# -- the Response object ---------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's reasoning (harmony's analysis channel), in the clear: no summary, no
    encrypted_content."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    prompt_cache_kept: PromptCacheKept = PromptCacheKept()  # radixkv's extension (protocol.py)


def response_usage(
    input_tokens: int, output_tokens: int, cached_tokens: int, cache_write_tokens: int = 0, reasoning_tokens: int = 0
) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens, cache_write_tokens=cache_write_tokens),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=input_tokens + output_tokens,
    )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class Reasoning(BaseModel):
    effort: str | None = None
    summary: str | None = None


class ResponseObject(BaseModel):
    """What the `openai` client parses as `Response`: the result and the request's settings
    echoed (the Agents SDK reads tools, tool_choice and the rest back from it)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = Field(default=None, max_length=CAPS.max_id_chars)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=dict)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    reasoning: Reasoning = Field(default_factory=Reasoning)
    background: bool = False
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    cache_report: dict[str, Any] | None = None  # radixkv's, when asked for; absent otherwise
    # OpenAI's, when prompt_cache_options.comparison_response_id asked; absent otherwise.
    prompt_cache_diagnostics: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _report_only_when_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in ("cache_report", "prompt_cache_diagnostics"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


def new_item_id(prefix: str) -> str:
    # OpenAI's ids are "<prefix>_<hex>" (chat's use a dash); the SDK only needs them unique.
    return f"{prefix}_{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
