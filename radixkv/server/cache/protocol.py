"""radixkv's own cache endpoints on the wire: pin, list and unpin a prefix, look up how much of a
prompt is cached, flush the cache (admin). A prefix comes as text, token ids or OpenAI chat messages.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from radixkv.server.openai.protocol import Messages


class PinRequest(BaseModel):
    """radixkv's own POST /v1/cache/pin: a prefix as text, token ids, or chat messages (rendered
    without the generation prompt, as the beginning of a longer conversation)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: Messages | None = None
    cache_salt: str | None = Field(default=None, max_length=1024)


class CacheLookupRequest(PinRequest):
    """radixkv's own POST /v1/cache/lookup: how much of a prompt (text, token ids, or chat
    messages rendered as a prefix, as for a pin) the caller's cache partition holds."""


class CacheFlushRequest(BaseModel):
    """radixkv's own POST /v1/cache/flush (admin only): which tiers to empty."""

    model_config = ConfigDict(extra="forbid")

    tier: Literal["ram", "disk", "all"] = "all"


class CacheLookupResponse(BaseModel):
    object: Literal["cache.lookup"] = "cache.lookup"
    prompt_tokens: int
    cached_tokens: int  # ram_tokens + disk_tokens: what a request for this prompt would not compute
    ram_tokens: int
    disk_tokens: int  # full blocks on disk right after those in RAM


class CacheFlushResponse(BaseModel):
    object: Literal["cache.flush"] = "cache.flush"
    tier: str
    freed_ram_pages: int
    freed_disk_blocks: int


class PinResponse(BaseModel):
    object: Literal["cache.pin"] = "cache.pin"
    pin_id: int
    pinned_tokens: int  # the prefix's full pages' worth of tokens now locked
    prompt_tokens: int
    expires_in_s: float | None = None  # None: until unpinned (the server's pin ttl is 0)


class PinList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PinResponse]


class UnpinResponse(BaseModel):
    object: Literal["cache.pin"] = "cache.pin"
    pin_id: int
    deleted: bool = True


class SessionResponse(BaseModel):
    """One of the caller's sessions (GET /v1/cache/sessions)."""

    object: Literal["cache.session"] = "cache.session"
    key: str
    retained_tokens: int  # the newest turn's full pages' worth of tokens retained now
    turns: int
    idle_s: float
    expires_in_s: float  # from its last activity; a turn running keeps it alive past 0
    turns_in_flight: int


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionResponse]


class SessionDeleted(BaseModel):
    object: Literal["cache.session"] = "cache.session"
    key: str
    deleted: bool = True
