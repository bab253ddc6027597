"""Exact continuation's memory and its encoder: per owner and cache partition (salt), a bounded
LRU map from a reply's exact text to the ids it was generated as (`ReplyMap`), read when the same
text comes back as an assistant message; `encode_conversation_exact` renders a conversation once
and splices the known replies back (radixkv.prompts.continuation). One owner's replies are
invisible to, and never pushed out by, another's; one partition's are never spliced in another.
The server keeps one map for every API key's owner; an `LLM` keeps one for its single owner.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.prompts import tools as tool_prompts
from radixkv.prompts.continuation import DEFAULT_MAX_SPLICED_REPLIES, Rendered, decodes_to, reply_ids, splice_replies
from radixkv.prompts.conversation import EncodedConversation, TemplateInput, encode_conversation
from radixkv.prompts.encode import render_chat
from radixkv.prompts.tools import Tool, ToolChoice, check_tool_choice

# An in-process owner's map (LLM): the server's per-key defaults (ServerLimits.max_replies_per_key,
# max_reply_tokens_per_key), since an LLM is one owner.
DEFAULT_MAX_REPLIES = 4096
DEFAULT_MAX_REPLY_TOKENS = 1 << 20


def _key(salt: str | None, text: str) -> bytes:
    # A digest keeps the map small; a hit is still checked by decoding its ids (ReplyMap.get),
    # so a collision costs a miss, never a wrong prompt. The salt goes in length-prefixed, with
    # None apart from "" (as the cache's partitions are), so no text reads as another salt's.
    digest = hashlib.blake2b(digest_size=16)
    salt_bytes = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
    digest.update((b"\x00" if salt is None else b"\x01") + len(salt_bytes).to_bytes(8, "little") + salt_bytes)
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.digest()


@dataclass(slots=True)
class _Held:
    """One owner's replies, least recently used first, and their tokens."""

    entries: OrderedDict[bytes, array] = field(default_factory=OrderedDict)
    num_tokens: int = 0


class ReplyMap:
    """(Salt, reply text) -> generated ids, per owner at most `max_entries_per_owner` replies
    and `max_tokens_per_owner` tokens over all its salts (past either, the owner's least
    recently used go: a new salt buys no new room), over all owners at most `max_tokens` (past
    it, the owner holding the most tokens loses its least recently used, so an owner within its
    share keeps its replies whoever else chats). A prompt splices at most
    `max_spliced_replies` of them."""

    def __init__(
        self, tokenizer: Any, max_entries_per_owner: int, max_tokens_per_owner: int, max_tokens: int,
        max_spliced_replies: int = DEFAULT_MAX_SPLICED_REPLIES,
    ) -> None:  # fmt: skip
        if min(max_entries_per_owner, max_tokens_per_owner, max_tokens) < 1:
            raise ValueError(f"a reply map needs room for one reply, got {max_entries_per_owner}, {max_tokens_per_owner}, {max_tokens}")
        self.tokenizer = tokenizer
        self.max_spliced_replies = max_spliced_replies
        self.max_entries_per_owner = max_entries_per_owner
        self.max_tokens_per_owner = max_tokens_per_owner
        self.max_tokens = max_tokens
        self._owners: dict[str | None, _Held] = {}
        self._num_tokens = 0
        self._lock = threading.Lock()  # read on parse threads, written on the event loop

    def remember(self, owner: str | None, text: str, token_ids: Sequence[int], *, salt: str | None = None) -> bool:
        """Keep a finished reply's ids under its partition and text; False (nothing kept) when
        no prefix of the ids decodes to exactly the text, or it alone is over a cap."""
        ids = reply_ids(self.tokenizer, text, token_ids)
        if ids is None or len(ids) > min(self.max_tokens_per_owner, self.max_tokens):
            return False
        key, packed = _key(salt, text), array("i", ids)
        with self._lock:
            held = self._owners.setdefault(owner, _Held())
            if key in held.entries:
                self._drop(owner, held, key)
                held = self._owners.setdefault(owner, _Held())
            while held.entries and (len(held.entries) >= self.max_entries_per_owner or held.num_tokens + len(ids) > self.max_tokens_per_owner):
                self._drop(owner, held, next(iter(held.entries)))
                held = self._owners.setdefault(owner, _Held())
            while self._num_tokens + len(ids) > self.max_tokens:
                fattest = max(self._owners, key=lambda o: self._owners[o].num_tokens)
                self._drop(fattest, self._owners[fattest], next(iter(self._owners[fattest].entries)))
            held = self._owners.setdefault(owner, _Held())
            held.entries[key] = packed
            held.num_tokens += len(ids)
            self._num_tokens += len(ids)
        return True

    def get(self, owner: str | None, text: str, *, salt: str | None = None) -> list[int] | None:
        """The ids `owner`'s reply with exactly this text was generated as in partition `salt`
        (marked recently used), or None: never seen, pushed out, another owner's or another
        partition's."""
        key = _key(salt, text)
        with self._lock:
            held = self._owners.get(owner)
            packed = None if held is None else held.entries.get(key)
            if packed is None:
                return None
            held.entries.move_to_end(key)  # type: ignore[union-attr]
        ids = packed.tolist()
        return ids if decodes_to(self.tokenizer, ids, text) else None

    def lookup_for(self, owner: str | None, salt: str | None) -> Callable[[str], list[int] | None]:
        return lambda text: self.get(owner, text, salt=salt)

    def held_by(self, owner: str | None) -> tuple[int, int]:
        """(replies, tokens) the owner has kept now."""
        with self._lock:
            held = self._owners.get(owner)
            return (0, 0) if held is None else (len(held.entries), held.num_tokens)

    def _drop(self, owner: str | None, held: _Held, key: bytes) -> None:
        size = len(held.entries.pop(key))
        held.num_tokens -= size
        self._num_tokens -= size
        if not held.entries:
            del self._owners[owner]


def encode_conversation_exact(
    replies: ReplyMap | None,
    owner: str | None,
    tokenizer: Any,
    messages: list[dict],
    tools: list[Tool],
    tool_choice: ToolChoice,
    *,
    salt: str | None,
    max_context_tokens: int,
    add_generation_prompt: bool = True,
) -> EncodedConversation:
    """The conversation rendered once (tool_prompts.render_conversation) as an
    EncodedConversation, with the owner's known replies in partition `salt` spliced back in as
    their generated ids where that is safe (radixkv.prompts.continuation.splice_replies); the
    plain encoding otherwise, and always without a map (continuation off). A plain prompt that
    leaves the context no room goes back as it is, with no reply looked up, for the engine to
    refuse (where every length is checked)."""
    check_tool_choice(tool_choice, tools)
    view = tool_prompts.template_input(tokenizer, messages, tools)
    normalized = tool_prompts.normalize_messages(messages)

    def rerender(generation: bool, with_tools: bool) -> str:
        return tool_prompts.render_conversation(tokenizer, normalized, tools if with_tools else [], add_generation_prompt=generation)

    encoded = encode_conversation(tokenizer, view, add_generation_prompt=add_generation_prompt, render=rerender)

    def render(ms: list[dict[str, Any]]) -> str:
        return tool_prompts.render_conversation(tokenizer, ms, tools, add_generation_prompt=add_generation_prompt)

    return _splice_known(replies, owner, tokenizer, encoded, normalized, render, salt, max_context_tokens)


def encode_chat_exact(
    replies: ReplyMap | None,
    owner: str | None,
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    salt: str | None,
    max_context_tokens: int,
    add_generation_prompt: bool = True,
) -> EncodedConversation:
    """Messages as the chat template takes them (no tools, nothing normalized: the plain ids are
    radixkv.prompts.encode_chat's), rendered once, with the owner's known replies spliced back
    as encode_conversation_exact does: LLM.chat's and the SDK's in-process encoder."""
    view = TemplateInput.plain(messages)
    encoded = encode_conversation(tokenizer, view, add_generation_prompt=add_generation_prompt)

    def render(ms: list[dict[str, Any]]) -> str:
        return render_chat(tokenizer, ms, add_generation_prompt=add_generation_prompt)

    return _splice_known(replies, owner, tokenizer, encoded, view.messages, render, salt, max_context_tokens)


def _splice_known(
    replies: ReplyMap | None, owner: str | None, tokenizer: Any, encoded: EncodedConversation, messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str], salt: str | None, max_context_tokens: int,
) -> EncodedConversation:  # fmt: skip
    """`encoded` with the known replies spliced into its token ids where safe; untouched without
    a map, or when its plain prompt leaves the context no room (the engine refuses it)."""
    if replies is None or len(encoded.plain_ids) >= max_context_tokens:
        return encoded
    lookup = replies.lookup_for(owner, salt)
    plain = Rendered(encoded.text, encoded.plain_ids)
    spliced = splice_replies(tokenizer, render, messages, lookup, plain=plain, max_replies=replies.max_spliced_replies)
    if spliced is not None:
        encoded.token_ids = spliced
    return encoded
