"""Sampling parameters: how a request's continuations are drawn (`SamplingParams`), the guides
that constrain them (`JsonGuide`, `GrammarGuide`) and the limits each is checked against where
it is made; what a wire format's fields become (server/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixkv.errors import InvalidRequest

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
    # A chat reply of a harmony model (gpt-oss): its stop strings match its content alone
    # (engine/detokenizer.py ContentStops), never its headers, reasoning or calls. Other models
    # and replies that do not read as harmony match the whole text as ever.
    stop_in_content: bool = False
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
            int_in("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        int_in("n", self.n, 1, MAX_N)
        int_in("top_k", self.top_k, 0, 1 << 20)
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature!r}", param="temperature")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None:
            int_in("seed", self.seed, MIN_SEED, MAX_SEED)
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
            int_in("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
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
        int_in("min_tokens", self.min_tokens, 0, self.max_tokens if self.max_tokens is not None else MAX_TOKENS_LIMIT)
        int_in("priority", self.priority, MIN_PRIORITY, MAX_PRIORITY)
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


def int_in(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name, limit=high)
