"""Anthropic's Messages API on the wire: the request body (system and content blocks, tools,
tool_choice, cache_control breakpoints) as pydantic models, and its error shape. Anthropic's
own names (cache_control, stop_sequences, input_schema) live only here and in the routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TTL_S = {"5m": 300.0, "1h": 3600.0}

# Anthropic's error type per HTTP status; 529 is its "overloaded".
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


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
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Wire):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolParam(_Wire):
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoiceParam(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(_Wire):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        return [TextBlock(type="text", text=self.system)] if isinstance(self.system, str) else list(self.system)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
