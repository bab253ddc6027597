"""The hosted APIs' cache diagnostics (Anthropic's `diagnostics.cache_miss_reason`, OpenAI's
`prompt_cache_diagnostics`): each answered prompt's fingerprint (keyed digests and counts, never
text) kept per owner, and where a new prompt first parts from the one an earlier id names.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixkv.errors import InvalidRequest
from radixkv.prompts.conversation import EncodedConversation
from radixkv.prompts.tools import normalize_messages
from radixkv.server import prompt_drift
from radixkv.server.prompt_drift import DriftDigests

DIGEST_BYTES = 16
# What a record costs against the byte caps besides its message digests (the fixed fields and
# the maps' entries, roughly).
RECORD_OVERHEAD_BYTES = 256


@dataclass(frozen=True, slots=True)
class PromptFingerprint:
    """One prompt as the diagnosis compares it: a digest per part, the prompt's length."""

    model: bytes  # the model served (an alias of the same model is the same model)
    partition: bytes  # the cache salt: prompts in other partitions never share a block
    system: bytes
    tools: bytes  # the tools as sent, in order: reordered tools or keys render another prompt
    options: bytes  # other settings the prompt is rendered with (tool choice)
    messages: tuple[bytes, ...]  # each chat message after the system one, as the template takes it
    num_prompt_tokens: int
    drift: DriftDigests | None = None  # what naming a drift needs (server/prompt_drift.py)

    @property
    def num_bytes(self) -> int:
        extra = self.drift.num_bytes if self.drift is not None else 0
        return RECORD_OVERHEAD_BYTES + DIGEST_BYTES * len(self.messages) + extra


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a prompt first differs from the compared one. `part` is None when nothing
    diverged; `start_token` is how many of this prompt's tokens come before the change (None:
    not found, the diagnosis is then unavailable)."""

    part: str | None  # "model" | "partition" | "system" | "tools" | "options" | "messages"
    start_token: int | None = None
    previous_prompt_tokens: int = 0
    prompt_tokens: int = 0
    drift: str | None = None  # the drift named (prompt_drift.DRIFT_REASONS), where one is

    @property
    def missed_previous_tokens(self) -> int:
        """The compared prompt's tokens past the change: what it could have served."""
        return max(0, self.previous_prompt_tokens - (self.start_token or 0))

    @property
    def reusable_tokens(self) -> int:
        return min(self.start_token or 0, self.previous_prompt_tokens)

    @property
    def missed_tokens(self) -> int:
        """This prompt's tokens past the change: what the compared one could not serve."""
        return max(0, self.prompt_tokens - (self.start_token or 0))


class Digester:
    """Keyed digests (BLAKE2b under a per-process random key): equal parts digest alike within
    one server, and a stored digest says nothing about a text outside it."""

    def __init__(self, argument_text: bool = False) -> None:
        self._key = secrets.token_bytes(32)
        # Whether the model's format prints a call's arguments as sent (harmony): then their
        # spacing changes the ids, and the digests.
        self._argument_text = argument_text

    def of(self, value: Any) -> bytes:
        data = value if isinstance(value, bytes) else json.dumps(value, ensure_ascii=False, default=str).encode()
        return hashlib.blake2b(data, key=self._key, digest_size=DIGEST_BYTES).digest()

    def fingerprint(
        self, *, model: str, salt: str | None, system: str | None, tools: list[dict[str, Any]], options: Any,
        messages: list[dict[str, Any]], num_prompt_tokens: int, token_ids: list[int] | None = None,
    ) -> PromptFingerprint:
        # The messages as the template is given them: what renders the same ids digests alike
        # (a content array of text parts or its string, a call's arguments in other spacing
        # where the format reparses them).
        try:
            messages = normalize_messages(messages, argument_text=self._argument_text)
        except InvalidRequest:
            pass  # never rendered: compared as sent
        drift = prompt_drift.drift_digests(self.of, system=system, tools=tools, messages=messages, token_ids=token_ids or ())
        return PromptFingerprint(
            self.of(model), self.of([salt]), self.of([system]), self.of(tools), self.of(options),
            tuple(self.of(m) for m in messages), num_prompt_tokens, drift,
        )  # fmt: skip


def diverge(previous: PromptFingerprint, current: PromptFingerprint, tokenizer: Any, encoded: EncodedConversation | None,
            message_offset: int) -> Divergence:
    """The first part of `current` that differs from `previous`, its drift named where one fits
    (prompt_drift): the same text tokenized to other ids before that part is a change of its own,
    at the first changed block."""
    found = _diverge_text(previous, current, tokenizer, encoded, message_offset)
    if previous.drift is None or current.drift is None or found.part in ("model", "partition"):
        return found
    at = None
    if found.part is None or found.start_token is not None:  # where the text changed is known (or it did not)
        at = prompt_drift.retokenized(previous.drift, current.drift, found.start_token if found.part else None)
    counts = {"previous_prompt_tokens": found.previous_prompt_tokens, "prompt_tokens": found.prompt_tokens}
    if at is not None:
        return Divergence("messages", at, **counts, drift="message_boundary_retokenized")
    if found.part == "tools":
        return Divergence("tools", found.start_token, **counts, drift=prompt_drift.tools_drift(previous.drift, current.drift))
    if found.part == "system":
        return Divergence("system", found.start_token, **counts, drift=prompt_drift.system_drift(previous.drift, current.drift))
    if found.part == "messages":
        k = _first_changed_message(previous, current)
        drift = prompt_drift.injected(previous.messages, current.messages, current.drift, k)
        return Divergence("messages", found.start_token, **counts, drift=drift)
    return found


def _first_changed_message(previous: PromptFingerprint, current: PromptFingerprint) -> int:
    for k, digest in enumerate(previous.messages):
        if k >= len(current.messages) or current.messages[k] != digest:
            return k
    return len(previous.messages)


def _diverge_text(previous: PromptFingerprint, current: PromptFingerprint, tokenizer: Any, encoded: EncodedConversation | None,
                  message_offset: int) -> Divergence:
    """The first part of `current` that differs from `previous`, in the order the prompt is
    laid out (the model and partition first: either changes every block). The change's token
    is read off this prompt's one rendering: before it the two prompts agree, so it is the
    same token in the compared one. `message_offset`: chat messages before the first request
    message (the system one)."""
    counts = {"previous_prompt_tokens": previous.num_prompt_tokens, "prompt_tokens": current.num_prompt_tokens}
    for part in ("model", "partition", "system"):
        if getattr(previous, part) != getattr(current, part):
            return Divergence(part, 0, **counts)
    if previous.tools != current.tools:
        return Divergence("tools", _tools_start(tokenizer, encoded), **counts)
    if previous.options != current.options:
        return Divergence("options", None, **counts)
    for k, digest in enumerate(previous.messages):
        if k >= len(current.messages) or current.messages[k] != digest:
            return Divergence("messages", _message_start(tokenizer, encoded, message_offset + k), **counts)
    return Divergence(None, previous.num_prompt_tokens, **counts)


def _tools_start(tokenizer: Any, encoded: EncodedConversation | None) -> int | None:
    if encoded is None:
        return None
    span = encoded.layout().tools_span
    return 0 if span is None else encoded.tokens_before_char(tokenizer, span[0])


def _message_start(tokenizer: Any, encoded: EncodedConversation | None, k: int) -> int | None:
    if encoded is None:
        return None
    if k >= len(encoded.view.roles):  # the compared prompt ran on past this one's messages
        return encoded.tokens_before_char(tokenizer, encoded.layout().generation_char)
    return encoded.message_start(tokenizer, k)


@dataclass(slots=True)
class _Holding:
    ids: OrderedDict[str, None]  # least recently used first
    num_bytes: int = 0


class DiagnosisStore:
    """Fingerprints by (owner, id), least recently used first. Per owner at most
    `max_records_per_owner` records and `max_bytes_per_owner` bytes (past either, the owner's
    own least recently used go); over all owners `max_records` and `max_bytes` (past either,
    the owner holding the most bytes loses its least recently used). Another owner's id is
    never found, exactly as an unknown one."""

    def __init__(
        self, max_records_per_owner: int, max_bytes_per_owner: int, max_records: int, max_bytes: int, argument_text: bool = False
    ) -> None:
        self.max_records_per_owner, self.max_bytes_per_owner = max_records_per_owner, max_bytes_per_owner
        self.max_records, self.max_bytes = max_records, max_bytes
        self.digester = Digester(argument_text)
        self._entries: dict[tuple[str | None, str], PromptFingerprint] = {}
        self._owners: dict[str | None, _Holding] = {}
        self._num_bytes = 0
        self._lock = threading.Lock()  # routes share one loop; a store may be shared by apps in threads

    def put(self, owner: str | None, record_id: str, fingerprint: PromptFingerprint) -> bool:
        """Keep a fingerprint (False, nothing kept, when it alone is over a byte cap)."""
        size = fingerprint.num_bytes
        if size > self.max_bytes_per_owner or size > self.max_bytes:
            return False
        with self._lock:
            if (owner, record_id) in self._entries:
                self._remove(owner, record_id)
            holding = self._owners.get(owner)
            while holding is not None and holding.ids and (
                len(holding.ids) >= self.max_records_per_owner or holding.num_bytes + size > self.max_bytes_per_owner
            ):
                self._remove(owner, next(iter(holding.ids)))
            while self._entries and (len(self._entries) >= self.max_records or self._num_bytes + size > self.max_bytes):
                largest_owner, largest = max(self._owners.items(), key=lambda item: (item[1].num_bytes, len(item[1].ids)))
                self._remove(largest_owner, next(iter(largest.ids)))
            self._entries[(owner, record_id)] = fingerprint
            holding = self._owners.setdefault(owner, _Holding(OrderedDict()))
            holding.ids[record_id] = None
            holding.num_bytes += size
            self._num_bytes += size
        return True

    def get(self, owner: str | None, record_id: str) -> PromptFingerprint | None:
        """The owner's fingerprint under that id (now its most recently used), or None."""
        with self._lock:
            found = self._entries.get((owner, record_id))
            if found is not None:
                self._owners[owner].ids.move_to_end(record_id)
            return found

    def held_by(self, owner: str | None) -> tuple[int, int]:
        """(records, bytes) the owner holds now."""
        with self._lock:
            holding = self._owners.get(owner)
            return (0, 0) if holding is None else (len(holding.ids), holding.num_bytes)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _remove(self, owner: str | None, record_id: str) -> None:
        fingerprint = self._entries.pop((owner, record_id))
        holding = self._owners[owner]
        del holding.ids[record_id]
        holding.num_bytes -= fingerprint.num_bytes
        self._num_bytes -= fingerprint.num_bytes
        if not holding.ids:
            del self._owners[owner]


# -- the wire shapes -------------------------------------------------------------------------


def anthropic_reason(divergence: Divergence | None) -> dict[str, Any] | None:
    """Anthropic's cache_miss_reason: None (nothing diverged) or one of its types; a None
    divergence is an id not found."""
    if divergence is None:
        return {"type": "previous_message_not_found"}
    if divergence.part is None:
        return None
    if divergence.start_token is None or divergence.part in ("options", "partition"):
        # The partition is radixkv's (a cache salt) and Anthropic has no reason for it.
        return {"type": "unavailable"}
    kind = {"model": "model_changed", "system": "system_changed", "tools": "tools_changed", "messages": "messages_changed"}[divergence.part]
    return {"type": kind, "cache_missed_input_tokens": divergence.missed_previous_tokens}


def openai_diagnostics(divergence: Divergence | None) -> dict[str, Any]:
    """OpenAI's prompt_cache_diagnostics; a None divergence is an id not found."""
    if divergence is None:
        return {"type": "comparison_response_not_found"}
    if divergence.part is None:
        return {"type": "cache_hit"}
    if divergence.start_token is None or divergence.part == "options":
        return {"type": "unavailable"}
    reason = {
        "model": "model_changed", "partition": "prompt_cache_key_changed", "tools": "tools_changed",
        "system": "input_changed", "messages": "input_changed",
    }[divergence.part]  # fmt: skip
    return {
        "type": "cache_miss", "reason": reason, "cache_missed_tokens": divergence.missed_tokens,
        "comparison_reusable_tokens": divergence.reusable_tokens, **drift_field(divergence),
    }  # fmt: skip


def drift_field(divergence: Divergence | None) -> dict[str, str]:
    """radixkv's `drift` beside the official fields (their enums unchanged, so the SDKs' types
    still parse): the drift named, or nothing."""
    return {"drift": divergence.drift} if divergence is not None and divergence.drift is not None else {}
