"""Anthropic's Messages API on the wire: the request body (system and content blocks, tools,
tool_choice, cache_control breakpoints) as pydantic models, and its error shape. Anthropic's
own names (cache_control, stop_sequences, input_schema) live only here and in the routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from radixkv.server.guards.request_caps import (
    CAPS,
    CapExceeded,
    check_arguments,
    check_schema,
    max_items,
)

TTL_S = {"5m": 300.0, "1h": 3600.0}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheControl(_Wire):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(_Wire):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = Field(max_length=CAPS.max_id_chars)
    name: str = Field(max_length=CAPS.max_anthropic_tool_name_chars)
    input: Annotated[dict[str, Any], AfterValidator(check_arguments)]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=CAPS.max_id_chars)
    content: Annotated[str | Annotated[list[TextBlock], Field(max_length=CAPS.max_content_blocks)], max_items(CAPS.max_content_blocks, "content blocks")] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Wire):
    """An assistant turn's reasoning handed back, as clients must with tool use under extended
    thinking; the signature is this server's (routes._thinking) and is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str = Field(default="", max_length=CAPS.max_opaque_chars)


class RedactedThinkingBlock(_Wire):
    """Reasoning another server encrypted: nothing here can read it, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str = Field(default="", max_length=CAPS.max_opaque_chars)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")]


class ThinkingParam(_Wire):
    """Extended thinking: "enabled" sends a reasoning model's reasoning as thinking blocks. The
    budget is taken as Anthropic checks it but bounds nothing: a harmony model reasons as it does."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)


class InputMessage(_Wire):
    role: Literal["user", "assistant"]
    content: Annotated[str | Annotated[list[Block], Field(max_length=CAPS.max_content_blocks)], max_items(CAPS.max_content_blocks, "content blocks")]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolParam(_Wire):
    name: str = Field(min_length=1, max_length=CAPS.max_anthropic_tool_name_chars)
    description: str = ""
    input_schema: Annotated[dict[str, Any], AfterValidator(check_schema)]
    cache_control: CacheControl | None = None


class ToolChoiceParam(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class DiagnosticsParam(_Wire):
    """Asks why the prompt cache could not reuse the prefix of an earlier message of this key's
    (server/cache_diagnostics.py); None: the first of a chain, nothing to compare."""

    previous_message_id: str | None = Field(default=None, max_length=CAPS.max_id_chars)


class MessagesRequest(_Wire):
    model: str
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[InputMessage], Field(min_length=1, max_length=CAPS.max_messages), max_items(CAPS.max_messages, "messages")]
    system: Annotated[str | Annotated[list[TextBlock], Field(max_length=CAPS.max_content_blocks)] | None, max_items(CAPS.max_content_blocks, "system blocks")] = None
    tools: Annotated[list[ToolParam] | None, Field(max_length=CAPS.max_tools), max_items(CAPS.max_tools, "tools")] = None
    tool_choice: ToolChoiceParam | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False
    # radixkv's own: the message carries its cache report (server/cache_report.py).
    cache_report: bool = False
    diagnostics: DiagnosticsParam | None = None  # Anthropic's cache diagnostics
    thinking: ThinkingParam | None = None

    @property
    def wants_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    @model_validator(mode="after")
    def _breakpoints_within_cap(self) -> MessagesRequest:
        # A breakpoint tokenizes its last turn again, and renders its prefix again where the
        # prompt's rendering cannot be aligned (anthropic/conversation.py), so their number
        # bounds that work; Anthropic allows 4 and counts them the same way.
        blocks: list[Any] = [*self.system_blocks(), *(self.tools or ())]
        for message in self.messages:
            for block in message.blocks():
                if isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
                    continue  # no cache_control on these
                blocks.append(block)
                if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                    blocks += block.content
        count = sum(1 for block in blocks if block.cache_control is not None)
        limit = CAPS.max_cache_breakpoints
        if count > limit:
            raise CapExceeded(f"at most {limit} blocks may carry cache_control, got {count}", limit=limit, param="cache_control")
        return self

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        return [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) else list(self.system)
