"""The OpenAI wire format the server speaks: request bodies, responses, stream chunks, errors.

Request models accept (and ignore) fields they do not know, as OpenAI clients send extras;
fields for features radixkv lacks are accepted only at their no-op values (`unsupported`).
Tools and response formats are checked and turned into engine terms in radixkv.server.tools.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, model_validator

from radixkv.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_STOP_TOKEN_IDS, GrammarGuide
from radixkv.errors import InvalidRequest
from radixkv.server.guards.request_caps import (
    CAPS,
    CapExceeded,
    check_arguments,
    check_schema,
    check_schema_or_none,
    max_items,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
# A regex's or grammar's characters, as a schema's bytes (the engine checks the bytes again).
MAX_GRAMMAR_CHARS = 128 << 10
# OpenAI's prompt_cache_retention values and how long each keeps a prompt's prefix cached.
RETENTION_TTL_S = {"in_memory": 3600.0, "24h": 86400.0}
# prompt_cache_options.ttl and a breakpoint's ttl: the least time a written breakpoint stays.
PROMPT_CACHE_TTL_S = {"30m": 1800.0, "12h": 43200.0}
# OpenAI matches up to the latest 80 breakpoints of a conversation (a multi-turn client sends
# its earlier turns' markers again) and writes up to 4; past 80 a request is refused.
MAX_MARKED_PARTS = 80


class PromptCacheBreakpoint(BaseModel):
    """OpenAI's prompt_cache_breakpoint on a content part: the prefix up to the part's end."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None  # None: the request's prompt_cache_options.ttl


class PromptCacheOptions(BaseModel):
    """OpenAI's prompt_cache_options: an implicit breakpoint at the prompt's end or only the
    explicit ones, the least lifetime of what is written, and prewarm (compute and retain the
    prompt, generate nothing)."""

    model_config = ConfigDict(extra="ignore")

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] = "30m"
    prewarm: bool = False
    # Responses only: the key's earlier response to diagnose this prompt's cache reuse against
    # (server/cache_diagnostics.py); another key's is never found.
    comparison_response_id: str | None = Field(default=None, max_length=CAPS.max_id_chars)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class FunctionCall(BaseModel):
    name: str = Field(max_length=CAPS.max_tool_name_chars)
    # JSON text, as OpenAI sends it; some clients send the object. Nesting is capped: json and
    # the chat template recurse once per level.
    arguments: Annotated[str | dict[str, Any], AfterValidator(check_arguments)] = "{}"


class MessageToolCall(BaseModel):
    id: str | None = Field(default=None, max_length=CAPS.max_id_chars)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | Annotated[list[TextPart], Field(max_length=CAPS.max_content_blocks)] | None, max_items(CAPS.max_content_blocks, "content parts")] = None
    name: str | None = Field(default=None, max_length=CAPS.max_id_chars)
    # Assistant turns that called tools.
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=CAPS.max_content_blocks)
    tool_call_id: str | None = Field(default=None, max_length=CAPS.max_id_chars)  # a tool turn: the call it answers
    # An assistant turn's reasoning handed back (what this server sends as reasoning_content;
    # some clients name it `reasoning`): a reasoning model's template prints it in the tool loop.
    reasoning_content: str | None = Field(default=None, validation_alias=AliasChoices("reasoning_content", "reasoning"))

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_chat(self) -> dict[str, Any]:
        """In transformers' chat format, as radixkv.prompts.tools.encode_conversation takes it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.reasoning_content and self.role == "assistant":
            message["reasoning_content"] = self.reasoning_content
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id or ""
        if self.name and self.role == "tool":
            message["name"] = self.name
        return message


class JsonSchemaFormat(BaseModel):
    name: str = Field(default="response", max_length=CAPS.max_tool_name_chars)
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, AfterValidator(check_schema_or_none)] = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    # radixkv's own: the response carries what the cache served and why no more
    # (server/cache_report.py); also asked by the header X-Radixkv-Cache-Report: 1.
    cache_report: bool = False
    # OpenAI's cache hints: the key is only recorded (it partitions nothing, as with OpenAI);
    # the retention asks that the prompt's prefix stay cached (RETENTION_TTL_S).
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None  # server/openai/prompt_cache.py
    # Token id (as a string, as OpenAI sends it) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)
    # vLLM's and SGLang's extensions, which benchmark clients (vLLM's, SGLang's, AIPerf,
    # guidellm) send: run through end-of-sequence tokens, a floor on the reply's length,
    # token ids that stop it, and top-k sampling.
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    top_k: int | None = None
    # vLLM's: lower goes first among this key's own requests (never ahead of another key's).
    priority: int = 0
    # Output held to a regular expression or an EBNF (GBNF) grammar: vLLM's names and SGLang's.
    guided_regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    guided_grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    regex: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    ebnf: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    # OpenAI's for chat; on completions it is vLLM's extension (the SDK's HTTP backend sends it).
    response_format: ResponseFormat | None = None
    # Features radixkv does not implement; accepted only when they ask for nothing.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def unsupported(self) -> str | None:
        """The name of a field that asks for something radixkv cannot do, if any."""
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.presence_penalty:
            return "presence_penalty"
        return None

    def grammar_guide(self) -> tuple[GrammarGuide | None, str | None]:
        """The regex or grammar the body asks its output to match, and the field it came in;
        InvalidRequest naming the second field when it sends more than one."""
        given = [(name, kind, text) for name, kind, text in (
            ("guided_regex", "regex", self.guided_regex), ("regex", "regex", self.regex),
            ("guided_grammar", "ebnf", self.guided_grammar), ("ebnf", "ebnf", self.ebnf),
        ) if text is not None]  # fmt: skip
        if len(given) > 1:
            raise InvalidRequest(f"send one of {given[0][0]} and {given[1][0]}, not both", param=given[1][0])
        if not given:
            return None, None
        name, kind, text = given[0]
        if not text:
            raise InvalidRequest(f"{name} is empty", param=name)
        return GrammarGuide(kind, text), name

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _check_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's name and schema against the caps; the rest is checked by tools.tool_from_openai."""
    spec = tool.get("function", tool)
    if isinstance(spec, dict):
        name = spec.get("name")
        if isinstance(name, str) and len(name) > CAPS.max_tool_name_chars:
            raise CapExceeded(f"a function name may be at most {CAPS.max_tool_name_chars} characters", limit=CAPS.max_tool_name_chars)
        if isinstance(spec.get("parameters"), dict):
            check_schema(spec["parameters"])
    return tool


Tools = Annotated[
    list[Annotated[dict[str, Any], AfterValidator(_check_tool)]], Field(max_length=CAPS.max_tools), max_items(CAPS.max_tools, "tools")
]
# max_items checks the count before any item is validated; Field(max_length) documents it in OpenAPI.
Messages = Annotated[list[ChatMessage], Field(max_length=CAPS.max_messages), max_items(CAPS.max_messages, "messages")]


class ChatCompletionRequest(_GenerationRequest):
    messages: Messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Tools | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _marked_parts_within_cap(self) -> ChatCompletionRequest:
        count = sum(1 for m in self.messages if isinstance(m.content, list) for p in m.content if p.prompt_cache_breakpoint)
        if count > MAX_MARKED_PARTS:
            raise CapExceeded(
                f"at most {MAX_MARKED_PARTS} content parts may carry prompt_cache_breakpoint, got {count}",
                limit=MAX_MARKED_PARTS, param="prompt_cache_breakpoint",
            )  # fmt: skip
        return self

    def num_logprobs(self) -> int | None:
        """The engine's logprobs: off, or how many most likely tokens to give with each."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
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


# -- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int | None = None  # prompt tokens a breakpoint or prewarm retained anew


class PromptCacheKept(BaseModel):
    """radixkv's extension beside usage (server/keeps.py prompt_cache_kept): the prompt's tokens
    its keeps hold now, and until when (Unix seconds; None: nothing kept, or pinned until unpinned)."""

    tokens: int = 0
    expires_at: int | None = None


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # A reasoning model's (harmony's analysis tokens); left out for a model that does not reason.
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=lambda v: v is None)
    prompt_cache_kept: PromptCacheKept = PromptCacheKept()


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ReplyFunction(BaseModel):
    name: str
    arguments: str


class ReplyToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ReplyFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ReplyToolCall] | None = None
    # A reasoning model's (harmony's analysis), as vLLM names it; left out where there is none.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str


class DeltaToolCall(BaseModel):
    """A streamed call: the first chunk of one has its id, type and name (and arguments ""),
    later ones more of its arguments; `index` tells the calls of one choice apart."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


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
    logprobs: dict[str, Any] | None = None


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
