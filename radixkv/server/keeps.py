"""Every wire spelling of keeping a prefix, as the engine's `Keep`s (as server/sampling.py makes
SamplingParams): OpenAI's prompt_cache_retention, prompt_cache_options and breakpoint markers,
Anthropic's cache_control, a pin; and the usage fields read back from the output's KeepReport.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestOutput
from radixkv.errors import InvalidRequest
from radixkv.server.anthropic.protocol import TTL_S as ANTHROPIC_TTL_S
from radixkv.server.errors import APIError
from radixkv.server.openai.protocol import PROMPT_CACHE_TTL_S, RETENTION_TTL_S, PromptCacheOptions

# OpenAI's: each request writes at most four breakpoints, the implicit one among them.
MAX_WRITTEN_BREAKPOINTS = 4

# A marked part: the prompt's tokens up to it (radixkv.prompts.tools.prefix_tokens; or
# InvalidRequest where the template will not render that prefix alone), and its ttl name
# (None: the request's).
Mark = tuple[Callable[[], int], str | None]


def retention(name: str | None, prompt: list[int]) -> tuple[Keep, ...]:
    """OpenAI's prompt_cache_retention: the whole prompt kept for its ttl (none without it)."""
    return () if name is None else (Keep(len(prompt), RETENTION_TTL_S[name]),)


def implicit_writes(options: PromptCacheOptions | None, prompt: list[int]) -> tuple[Keep, ...]:
    """A completion prompt has no parts to mark: in implicit mode the whole prompt is written,
    in explicit mode (or without options) nothing."""
    if options is None or options.mode == "explicit":
        return ()
    return (Keep(len(prompt), PROMPT_CACHE_TTL_S[options.ttl]),)


def breakpoint_writes(options: PromptCacheOptions | None, marks: list[Mark], prompt: list[int]) -> tuple[Keep, ...]:
    """The latest marks (three beside the implicit one at the prompt's end, four in explicit
    mode), each as the prompt's tokens up to it; nothing without options or marks."""
    if options is None and not marks:
        return ()
    options = options or PromptCacheOptions()
    implicit = options.mode == "implicit"
    latest = marks[len(marks) - (MAX_WRITTEN_BREAKPOINTS - int(implicit)) :] if marks else []
    default_ttl_s = PROMPT_CACHE_TTL_S[options.ttl]
    writes = []
    for measure, ttl in latest:
        try:
            num_tokens = measure()
        except (InvalidRequest, APIError):
            continue  # a prefix the template will not render alone marks nothing
        writes.append(Keep(num_tokens, PROMPT_CACHE_TTL_S[ttl] if ttl else default_ttl_s))
    if implicit:
        writes.append(Keep(len(prompt), default_ttl_s))
    return tuple(writes)


def cache_control(num_tokens: int, ttl: str) -> Keep:
    """One of Anthropic's cache_control breakpoints: the prompt's tokens up to and including
    the marked block (server/anthropic/conversation.py finds them), kept for its ttl."""
    return Keep(num_tokens, ANTHROPIC_TTL_S[ttl])


def pin(prompt: list[int], ttl_s: float | None) -> tuple[Keep, ...]:
    """POST /v1/cache/pin: the whole prefix locked (ttl None: until unpinned), applied by its
    one warming request."""
    return (Keep(len(prompt), ttl_s, lock=True),)


def written_tokens(output: RequestOutput, num_writes: int) -> int:
    """OpenAI's cache_write_tokens for one prompt: of its last `num_writes` keeps (its
    breakpoints), the most kept beyond what the cache served."""
    report = output.kept
    if report is None or num_writes == 0:
        return 0
    return max(0, max(report.num_kept_tokens[-num_writes:]) - output.num_cached_tokens)


def creation_tokens(output: RequestOutput) -> int:
    """Anthropic's cache_creation_input_tokens: the tokens up to the last breakpoint that were
    computed now and are now kept."""
    report = output.kept
    if report is None or not report.num_kept_tokens:
        return 0
    return max(0, report.num_kept_tokens[-1] - output.num_cached_tokens)



def prompt_cache_kept(outputs: Sequence[RequestOutput]) -> dict[str, int | None]:
    """radixkv's own usage field (`prompt_cache_kept`, beside each wire format's usage): how many
    of the prompts' tokens their keeps hold now (the most any keep of each prompt kept, summed)
    and until when (Unix seconds, the latest expiry; None: nothing kept, or pinned until
    unpinned). A session's turn is kept when its reply ends, before the last output is made, so it
    is counted here."""
    reports = [o.kept for o in outputs if o.kept is not None]
    expiries = [r.expires_at_epoch_s for r in reports if r.expires_at_epoch_s is not None and r.most_kept_tokens]
    return {
        "tokens": sum(r.most_kept_tokens for r in reports),
        "expires_at": int(max(expiries)) if expiries else None,
    }


def cache_creation_by_ttl(output: RequestOutput, breakpoints: Sequence[Keep]) -> dict[str, int]:
    """Anthropic's usage.cache_creation: creation_tokens split by the ttl of the breakpoint
    that wrote them (each breakpoint's kept tokens past the cache's and the earlier ones'), so
    the two add up to cache_creation_input_tokens."""
    split = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    report = output.kept
    if report is None or not report.num_kept_tokens or len(report.num_kept_tokens) != len(breakpoints):
        return split
    end = report.num_kept_tokens[-1]
    done = output.num_cached_tokens
    for kept, keep in zip(report.num_kept_tokens, breakpoints, strict=True):
        upto = min(kept, end)
        if upto > done:
            name = "ephemeral_1h_input_tokens" if (keep.ttl_s or 0) > ANTHROPIC_TTL_S["5m"] else "ephemeral_5m_input_tokens"
            split[name] += upto - done
            done = upto
    return split
