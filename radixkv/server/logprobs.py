"""The engine's TokenLogprobs in OpenAI's two shapes: chat's `logprobs.content` (token, logprob,
bytes, top_logprobs) and the legacy completions' parallel lists (tokens, token_logprobs,
top_logprobs, text_offset). Token text and bytes come from the tokenizer, cached per id.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from radixkv.engine.request_output import TokenLogprob

# A sentencepiece byte-fallback piece: the token is one raw byte.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable bytes stand for themselves, the others
    for the characters from U+0100 on (transformers no longer exports its copy)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


class TokenTexts:
    """A token id's bytes (what OpenAI's `bytes` lists) and text; a token that holds part of a
    UTF-8 character has no text of its own, and shows U+FFFD as OpenAI's tokenizer does."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._compute(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _compute(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self._special or not isinstance(piece, str):
            return self._tokenizer.decode([token_id]).encode("utf-8")
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        decoder = _byte_decoder()
        if all(char in decoder for char in piece):  # byte-level BPE (GPT-2, Llama 3, SmolLM)
            return bytes(decoder[char] for char in piece)
        return piece.replace("\u2581", " ").encode("utf-8")  # sentencepiece's word boundary


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob], top: int) -> dict[str, Any]:
    """Chat's choice.logprobs: one entry per token, each with its `top` most likely."""
    return {"content": [_chat_entry(texts, lp, top) for lp in logprobs], "refusal": None}


def _chat_entry(texts: TokenTexts, logprob: TokenLogprob, top: int) -> dict[str, Any]:
    entry = _token_entry(texts, logprob.token_id, logprob.logprob)
    entry["top_logprobs"] = [_token_entry(texts, token_id, value) for token_id, value in logprob.top[:top]]
    return entry


def _token_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts.text_of(token_id), "logprob": logprob, "bytes": list(texts.bytes_of(token_id))}


def completion_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob], top: int, text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions' logprobs; text_offset counts characters from the start of the
    completion's text (from earlier chunks when streamed)."""
    tokens = [texts.text_of(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [_top_map(texts, lp, top) for lp in logprobs],
        "text_offset": offsets,
    }


def _top_map(texts: TokenTexts, logprob: TokenLogprob, top: int) -> dict[str, float]:
    # Two ids may share a text; keep the likelier, as a mapping keeps one.
    out: dict[str, float] = {}
    for token_id, value in logprob.top[:top]:
        out.setdefault(texts.text_of(token_id), value)
    return out
