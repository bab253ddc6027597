"""Every wire format's request as the engine's `SamplingParams`, with each format's names for the
engine's parameters (`errors.WireNames`), so an engine error names the field the client sent. A
format's own defaults live here; the checks (context, ranges, seeds) are SamplingParams' and
the engine's alone.
"""

from __future__ import annotations

from radixkv.engine.sampling_params import Guide, JsonGuide, SamplingParams
from radixkv.errors import InvalidRequest
from radixkv.server.anthropic.protocol import MessagesRequest
from radixkv.server.errors import WireNames, engine_error
from radixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.openai.responses_protocol import ResponsesRequest

# OpenAI's default for the legacy completions API; chat and Responses default to the room left
# (max_tokens None), Anthropic's Messages require max_tokens.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's and Anthropic's default temperature when a request leaves it out.
DEFAULT_TEMPERATURE = 1.0
# A logit_bias key (a token id as a string) has at most this many digits: vocabularies are far
# below 10**9. A longer key is refused before int(), which raises past its own digit limit and
# whose work grows with the digits; a shorter one past the vocabulary is the engine's to refuse.
MAX_TOKEN_ID_DIGITS = 9


COMPLETIONS_NAMES = WireNames()
MESSAGES_NAMES = WireNames(prompt="messages", max_tokens="max_tokens")


def chat_names(body: ChatCompletionRequest, guide_param: str = "response_format") -> WireNames:
    return WireNames(prompt="messages", max_tokens=body.requested_max_tokens()[1], guide=guide_param)


def responses_names(guide_param: str) -> WireNames:
    return WireNames(prompt="input", max_tokens="max_output_tokens", guide=guide_param)


def chat_params(body: ChatCompletionRequest, names: WireNames, guide: Guide | None = None) -> SamplingParams:
    """OpenAI chat: max_completion_tokens (or max_tokens), else the room the context leaves."""
    return _params(
        names,
        max_tokens=body.requested_max_tokens()[0],
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        stop_in_content=True,
        n=body.n,
        guide=guide,
        logprobs=body.num_logprobs(),
        **_extension_params(body, names),
    )


def completion_names(guide_param: str) -> WireNames:
    return WireNames(guide=guide_param)


def completion_params(
    body: CompletionRequest, context_tokens: int, longest_prompt: int, names: WireNames = COMPLETIONS_NAMES, guide: Guide | None = None
) -> SamplingParams:
    """OpenAI completions: max_tokens, else 16, or the room the longest prompt leaves when that
    is less (a default, not a check: a prompt that leaves no room is the engine's to refuse)."""
    max_tokens = body.max_tokens
    if max_tokens is None:
        room = context_tokens - longest_prompt
        max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, room) if room > 0 else None
    return _params(
        names,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        n=body.n,
        logprobs=body.num_logprobs(),
        guide=guide,
        **_extension_params(body, names),
    )


def _extension_params(body: ChatCompletionRequest | CompletionRequest, names: WireNames) -> dict:
    """The OpenAI endpoints' token-level fields (logit_bias, and vLLM's ignore_eos, min_tokens,
    stop_token_ids, top_k) and vLLM's priority as SamplingParams' arguments; logit_bias keys
    are token ids sent as strings, as OpenAI's API has them."""
    logit_bias = {}
    for key, bias in (body.logit_bias or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > MAX_TOKEN_ID_DIGITS:
            message = f"logit_bias keys must be token ids of at most {MAX_TOKEN_ID_DIGITS} digits, got {key[:32]!r}"
            raise engine_error(InvalidRequest(message, param="logit_bias", limit=MAX_TOKEN_ID_DIGITS), names)
        logit_bias[int(key)] = bias
    return dict(
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        stop_token_ids=list(body.stop_token_ids or []),
        top_k=body.top_k or 0,
        logit_bias=logit_bias,
        priority=body.priority,
    )


def responses_params(body: ResponsesRequest, names: WireNames, guide: Guide | None = None) -> SamplingParams:
    """OpenAI Responses: max_output_tokens, else the room the context leaves."""
    return _params(names, max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed, guide=guide)


def messages_params(body: MessagesRequest, guide: JsonGuide | None = None) -> SamplingParams:
    """Anthropic Messages: max_tokens is required (the wire model refuses a body without it)."""
    return _params(
        MESSAGES_NAMES,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or 0,
        stop=list(body.stop_sequences or []),
        stop_in_content=True,
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
    stop_in_content: bool = False,
    n: int = 1,
    guide: Guide | None = None,
    logprobs: int | None = None,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    logit_bias: dict[int, float] | None = None,
    priority: int = 0,
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k,
            seed=seed,
            stop=stop or [],
            stop_in_content=stop_in_content,
            n=n,
            guide=guide,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids or [],
            logit_bias=logit_bias or {},
            priority=priority,
        )
    except InvalidRequest as error:
        raise engine_error(error, names) from None
