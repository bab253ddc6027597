"""What a request gives back: each generated token's logprobs, a continuation's output
(`CompletionOutput`) and what it gained in a step (`CompletionDelta`), a request's `RequestDelta`
per step and its whole `RequestOutput` on the last one, with what its keeps did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.cache_report import CacheReport
    from radixkv.engine.request import KeepReport


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability (log-softmax of the raw logits) and the k most
    likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for
    # A reasoning model's chat reply (gpt-oss's analysis), split off `text` by LLM.chat; None otherwise.
    reasoning: str | None = None
    stop_string: str | None = None  # the request's stop string that ended it, where one did


@dataclass(slots=True)
class CompletionDelta:
    """What one continuation gained in a step: text safe to send (no stop string will cut it
    later) and token ids; finish_reason once it has ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token when asked for

    def extend(self, later: CompletionDelta) -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason or self.finish_reason


@dataclass(slots=True)
class RequestDelta:
    """What a request gained in a step; `output` (the whole result) only on its last delta."""

    request_id: str
    completions: list[CompletionDelta]  # the continuations that changed, by index
    num_prompt_tokens: int
    num_cached_tokens: int
    time_to_first_token_s: float | None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


def merge_deltas(deltas: Sequence[RequestDelta]) -> RequestDelta:
    """Consecutive deltas of one request as one, in time linear in their total size (a stalled
    consumer's backlog is joined once, not re-copied per step)."""
    if len(deltas) == 1:
        return deltas[0]
    parts: dict[int, list[CompletionDelta]] = {}
    for delta in deltas:
        for c in delta.completions:
            parts.setdefault(c.index, []).append(c)
    last = deltas[-1]
    return RequestDelta(
        last.request_id,
        [_join(parts[i]) for i in sorted(parts)],
        last.num_prompt_tokens,
        last.num_cached_tokens,
        last.time_to_first_token_s,
        last.output,
    )


def _join(parts: list[CompletionDelta]) -> CompletionDelta:
    return CompletionDelta(
        parts[0].index,
        "".join(c.text for c in parts),
        [t for c in parts for t in c.token_ids],
        next((c.finish_reason for c in reversed(parts) if c.finish_reason is not None), None),
        [lp for c in parts for lp in c.logprobs],
    )


@dataclass(slots=True)
class RequestOutput:
    """A request's result: the outputs of every continuation, token counts and timings."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_prompt_tokens: int
    num_cached_tokens: int
    time_to_first_token_s: float | None
    total_time_s: float | None
    cache_report: CacheReport | None = None  # what the cache served the prompt, and why no more
    kept: KeepReport | None = None  # what its keeps did; None without keeps or before its prompt was computed

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
