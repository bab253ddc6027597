"""Every wire format's request as the engine's `SamplingParams`, and each format's names for the
engine's parameters (`WireNames`), so an engine error names the field the client sent. A
format's own defaults live here; the checks (context, ranges, seeds) are SamplingParams' and
the engine's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.engine.request import JsonGuide, SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.errors import engine_error
from radixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.openai.responses_protocol import ResponsesRequest

# OpenAI's default for the legacy completions API; chat and Responses default to the room left
# (max_tokens None), Anthropic's Messages require max_tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's and Anthropic's default temperature when a request leaves it out.
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True, slots=True)
class WireNames:
    """One wire format's names for the engine's parameters, the one place they are mapped: a
    chat request's prompt is its `messages`, its max_tokens may be `max_completion_tokens`, a
    Responses request's are `input` and `max_output_tokens`. `guide` is the field a JSON guide
    came from (response_format, text.format, or tools when a call is forced); None keeps the
    engine's name."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    guide: str | None = None

    def of(self, param: str | None) -> str | None:
        if param == "prompt":
            return self.prompt
        if param == "max_tokens":
            return self.max_tokens
        if param in ("response_format", "guide") and self.guide is not None:
            return self.guide
        return param


COMPLETIONS_NAMES = WireNames()
MESSAGES_NAMES = WireNames(prompt="messages", max_tokens="max_tokens")


def chat_names(body: ChatCompletionRequest, guide_param: str = "response_format") -> WireNames:
    return WireNames(prompt="messages", max_tokens=body.requested_max_tokens()[1], guide=guide_param)


def responses_names(guide_param: str) -> WireNames:
    return WireNames(prompt="input", max_tokens="max_output_tokens", guide=guide_param)


def chat_params(body: ChatCompletionRequest, names: WireNames, guide: JsonGuide | None = None) -> SamplingParams:
    """OpenAI chat: max_completion_tokens (or max_tokens), else the room the context leaves."""
    return _params(
        names,
        max_tokens=body.requested_max_tokens()[0],
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        n=body.n,
        guide=guide,
        logprobs=body.num_logprobs(),
    )


def completion_params(body: CompletionRequest, context_tokens: int, longest_prompt: int) -> SamplingParams:
    """OpenAI completions: max_tokens, else 16, or the room the longest prompt leaves when that
    is less (a default, not a check: a prompt that leaves no room is the engine's to refuse)."""
    max_tokens = body.max_tokens
    if max_tokens is None:
        room = context_tokens - longest_prompt
        max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if room > 0 else None
    return _params(
        COMPLETIONS_NAMES,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        n=body.n,
        logprobs=body.num_logprobs(),
    )


def responses_params(body: ResponsesRequest, names: WireNames, guide: JsonGuide | None = None) -> SamplingParams:
    """OpenAI Responses: max_output_tokens, else the room the context leaves."""
    return _params(names, max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, guide=guide)


def messages_params(body: MessagesRequest, guide: JsonGuide | None = None) -> SamplingParams:
    """Anthropic Messages: max_tokens is required (the wire model refuses a body without it)."""
    return _params(
        MESSAGES_NAMES,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or 0,
        stop=list(body.stop_sequences or []),
        guide=guide,
    )


def _params(
    names: WireNames,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None = None,
    top_k: int = 0,
    stop: list[str] | None = None,
    n: int = 1,
    guide: JsonGuide | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k,
            seed=seed,
            stop=stop or [],
            n=n,
            guide=guide,
            logprobs=logprobs,
        )
    except InvalidRequest as error:
        raise engine_error(error, names) from None
