"""A request's life in the engine: its sampling parameters, tokens, pages and outputs.

`SamplingParams` is validated where it is made; a `Keep` says what of the prompt stays cached
once it is computed; `SequenceState` is one generated continuation (a request with n > 1 has n
of them); a step runs a `Batch` of their chunks, whose pages KVManager gave as `Admitted`; each
step emits a `RequestDelta` (what is new) per request that changed, and the last one carries the
whole `RequestOutput`, with what its keeps did (`KeepReport`).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixkv.engine.cache_report import CacheReport
from radixkv.engine.detokenizer import TextState
from radixkv.errors import InvalidRequest

if TYPE_CHECKING:
    from radixkv.engine.pins import PinnedPrefix

MAX_TOKENS_LIMIT = 1 << 20
MAX_N = 64
MAX_STOP_STRINGS = 16
# Characters per stop string: each new token is checked against every stop's length in
# held-back text, so a client must not make that work (or the held-back tail) unbounded.
MAX_STOP_CHARS = 256
MIN_SAMPLING_TEMPERATURE = 1e-5
# Any 64-bit seed, signed or unsigned (OpenAI's clients send either): the sampler maps it onto
# its generator's range, so every seed in here names one reproducible stream.
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 64) - 1
MAX_TOP_LOGPROBS = 20
# OpenAI's own caps: at most 300 biased tokens, each bias in [-100, 100].
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0
# Stop token ids are checked against every sampled token: a handful is what clients send.
MAX_STOP_TOKEN_IDS = 64
# A request's priority (vLLM's field: lower goes first), within 32 bits as vLLM's clients send it.
MIN_PRIORITY, MAX_PRIORITY = -(1 << 31), (1 << 31) - 1
# Keeps per request: the wire formats ask for at most four breakpoints each (OpenAI's writes,
# Anthropic's cache_control), beside a retention of the whole prompt; room to spare, but bounded,
# since each keep is a tree match on the engine's thread.
MAX_KEEPS = 8


@dataclass(frozen=True, slots=True)
class JsonGuide:
    """Constrains a continuation to JSON while it is decoded: any JSON object (schema None) or
    one matching a JSON Schema (given as JSON text)."""

    schema: str | None = None
    strict: bool = True  # no properties beyond those the schema names


@dataclass(frozen=True, slots=True)
class GrammarGuide:
    """Constrains a continuation to a regular expression (kind "regex") or to an EBNF grammar
    (kind "ebnf": llama.cpp's GBNF dialect, as xgrammar reads it, with a `root` rule)."""

    kind: str
    source: str


GRAMMAR_KINDS = ("regex", "ebnf")
Guide = JsonGuide | GrammarGuide


@dataclass(slots=True)
class SamplingParams:
    # None: the room the context leaves after the prompt, filled in per request by the engine.
    max_tokens: int | None = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # run to max_tokens through end-of-sequence tokens (benchmark clients)
    # Neither an end-of-sequence token nor a stop token id is drawn before this many tokens
    # (stop strings still stop), as vLLM's min_tokens.
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Lower goes first among one owner's requests, and may preempt that owner's higher ones
    # when pages run short; another owner's requests are never reordered by it.
    priority: int = 0
    n: int = 1
    guide: Guide | None = None
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the k most likely

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows to inf; it is argmax anyway.
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def validate(self) -> None:
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        _int_in("n", self.n, 1, MAX_N)
        _int_in("top_k", self.top_k, 0, 1 << 20)
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature!r}", param="temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None:
            _int_in("seed", self.seed, MIN_SEED, MAX_SEED)
        if len(self.stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}", param="stop", limit=MAX_STOP_STRINGS
            )
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each stop string may be at most {MAX_STOP_CHARS} characters, got one of {longest}", param="stop", limit=MAX_STOP_CHARS
            )
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.guide is not None and not isinstance(self.guide, (JsonGuide, GrammarGuide)):
            raise InvalidRequest(f"guide must be a JsonGuide or a GrammarGuide, got {type(self.guide).__name__}", param="guide")
        if isinstance(self.guide, GrammarGuide) and (self.guide.kind not in GRAMMAR_KINDS or not isinstance(self.guide.source, str) or not self.guide.source):
            raise InvalidRequest(f"a grammar guide is a non-empty regex or ebnf text, got {self.guide.kind!r}", param="guide")
        self._validate_token_controls()

    def _validate_token_controls(self) -> None:
        """stop_token_ids, min_tokens and logit_bias: counts and ranges (that each id is a token
        of the model is the engine's check, which knows the vocabulary)."""
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
                param="stop_token_ids", limit=MAX_STOP_TOKEN_IDS,
            )  # fmt: skip
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}", param="stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", param="ignore_eos")
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens if self.max_tokens is not None else MAX_TOKENS_LIMIT)
        _int_in("priority", self.priority, MIN_PRIORITY, MAX_PRIORITY)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest(
                f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}",
                param="logit_bias", limit=MAX_LOGIT_BIAS_TOKENS,
            )  # fmt: skip
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids (non-negative integers), got {token!r}", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}",
                    param="logit_bias", limit=MAX_LOGIT_BIAS,
                )  # fmt: skip

    def token_ids_named(self) -> list[int]:
        """Every token id these params name (stop ids, biased tokens), for the vocabulary check."""
        return [*self.stop_token_ids, *self.logit_bias]

    @property
    def steers_logits(self) -> bool:
        """Whether the sampler changes this request's logits beyond a guide's mask."""
        return bool(self.logit_bias) or self.min_tokens > 0


def _int_in(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name, limit=high)


@dataclass(frozen=True, slots=True)
class Keep:
    """What of a request's prompt stays cached once the engine has computed it: the prompt's
    first `num_tokens` (their full pages), for `ttl_s` seconds. Unlocked, it is a retention:
    evicted last, earliest expiry first, capped per owner. Locked, it is a pin: never evicted
    until it expires (`ttl_s` None: until unpinned), under the pin caps. Every wire spelling
    (retention, breakpoints, cache_control, pins, sessions) is one of these (server/keeps.py).

    `reply`: the keep reaches past the prompt's first `num_tokens` into the first continuation's
    reply, so it is applied when the request finishes (the reply exists only then), never
    locked, and not part of the prompt's `KeepReport`. A session's newest turn is one
    (engine/sessions.py makes it, whole prompt and reply, its idle time the ttl)."""

    num_tokens: int
    ttl_s: float | None = 300.0
    lock: bool = False
    reply: bool = False

    def check(self, num_prompt_tokens: int) -> None:
        """InvalidRequest (param "keeps") unless this keep names a prefix of a prompt of
        `num_prompt_tokens` tokens and a lifetime it may have; changes nothing."""
        _int_in("keeps", self.num_tokens, 0, num_prompt_tokens)
        if not isinstance(self.lock, bool):
            raise InvalidRequest(f"a keep's lock must be a boolean, got {self.lock!r}", param="keeps")
        if not isinstance(self.reply, bool) or (self.reply and self.lock):
            raise InvalidRequest(f"a keep that reaches into the reply is a boolean and never locked, got {self.reply!r}", param="keeps")
        ttl_s = self.ttl_s
        if ttl_s is None and self.lock:
            return
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < float("inf"):
            raise InvalidRequest(f"a keep's ttl must be a positive number of seconds, got {ttl_s!r}", param="ttl")


@dataclass(frozen=True, slots=True)
class KeepReport:
    """What a request's keeps did, applied once right after the step that computed its prompt:
    per keep (in the request's order) the tokens it kept (0: none, trimmed by a cap or not
    cached); of the most kept, the tokens this request computed rather than found cached
    (written); the latest expiry among them on the tree's clock (None: nothing kept, or only
    locked until unpinned); the pin a locked keep made, or why the pin caps refused it."""

    num_kept_tokens: tuple[int, ...]
    num_written_tokens: int
    expires_at_s: float | None
    pin: PinnedPrefix | None = None
    error: InvalidRequest | None = None

    @property
    def most_kept_tokens(self) -> int:
        return max(self.num_kept_tokens, default=0)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SequenceState:
    """One continuation of a prompt, and the KV pages it holds while it runs."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n continuations
    prompt_token_ids: list[int]
    params: SamplingParams
    salt: str | None
    arrival_step: int
    arrival_time: float = field(default_factory=time.perf_counter)
    # Whose share of the batch it takes (the server's Tenants.owner of its API key); None for
    # in-process callers, who are one owner together.
    owner: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # KV state: page_table[i] holds tokens [i*page_size, (i+1)*page_size); the sequence holds
    # one pool reference on each. The first num_tree_blocks pages are the tree's (locked
    # through tree_node); the rest are private.
    page_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    num_tree_blocks: int = 0
    tree_node: Any = None
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks of all_token_ids
    num_preemptions: int = 0
    text_state: TextState = field(init=False)
    num_sent_tokens: int = 0  # output tokens already handed out in a delta
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: Any = None  # torch.Generator for seeded sampling
    # Where a guided continuation stands in its grammar (a guide.GuideState); it survives
    # preemption with the output tokens it has accepted.
    guide_state: Any = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token when asked for
    # Why the cache served what it did, made at first admission (the request's first sequence
    # only); and the owner's other partitions that report may name (engine/cache_report.py).
    cache_report: CacheReport | None = None
    sibling_salts: tuple[str | None, ...] = ()
    # What the request keeps once its prompt is computed, and what that did (set on every
    # sequence of the request by the first to compute the prompt: applied once, even across
    # preemption).
    keeps: tuple[Keep, ...] = ()
    kept: KeepReport | None = None

    def __post_init__(self) -> None:
        self.text_state = TextState(tuple(self.params.stop))

    @property
    def text(self) -> str:
        return self.text_state.text

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(frozen=True, slots=True)
class Admitted:
    """What KVManager.admit or .reserve gave a sequence for its next chunk: the tokens whose KV
    it now holds (cached in RAM, or loaded), of them those loaded from the disk tier by this
    call, and whether the hit goes on past the chunk (then nothing is computed this step: the
    next chunk loads on, as ending inside a block would cut the hit short there)."""

    num_cached_tokens: int
    num_loaded_tokens: int
    more_to_load: bool


@dataclass(frozen=True, slots=True)
class CacheLookup:
    """How much of a prompt the cache holds, in full blocks, found without changing anything:
    the tokens cached in RAM, and the tokens cached on disk right after those."""

    num_ram_tokens: int
    num_disk_tokens: int

    @property
    def num_cached_tokens(self) -> int:
        return self.num_ram_tokens + self.num_disk_tokens


@dataclass(slots=True)
class ScheduledSeq:
    seq: SequenceState
    num_new_tokens: int
    samples: bool  # this chunk reaches the sequence's last token, so a new token is drawn


@dataclass(slots=True)
class Batch:
    """One step's work: the chunks to compute, and what the scheduler did besides."""

    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)
    # Tokens loaded into pages this step by sequences with nothing to compute yet (their hit
    # goes on past this chunk): progress, though no item runs for them.
    num_loaded_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


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
