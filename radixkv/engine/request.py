"""A request's life in the engine: what it keeps and its sequences' state.

A `Keep` says what of the prompt (or, for a session's turn, of the reply too) stays cached once
it is computed, and `KeepReport` what that did; `SequenceState` is one generated continuation (a
request with n > 1 has n of them); a step runs a `Batch` of their chunks, whose pages KVManager
gave as `Admitted`. Its parameters are engine/sampling_params.py's, its outputs
engine/request_output.py's.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixkv.engine.detokenizer import TextState
from radixkv.engine.sampling_params import SamplingParams, int_in
from radixkv.errors import InvalidRequest

if TYPE_CHECKING:
    from radixkv.engine.cache_report import CacheReport
    from radixkv.engine.pins import PinnedPrefix
    from radixkv.engine.request_output import TokenLogprob

# Keeps per request: the wire formats ask for at most four breakpoints each (OpenAI's writes,
# Anthropic's cache_control), beside a retention of the whole prompt; room to spare, but bounded,
# since each keep is a tree match on the engine's thread.
MAX_KEEPS = 8



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
        int_in("keeps", self.num_tokens, 0, num_prompt_tokens)
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
    locked until unpinned); the pin a locked keep made, or why the pin caps refused it; that
    expiry as a Unix time (what a response echoes: the tree's clock is the engine's own)."""

    num_kept_tokens: tuple[int, ...]
    num_written_tokens: int
    expires_at_s: float | None
    pin: PinnedPrefix | None = None
    error: InvalidRequest | None = None
    expires_at_epoch_s: float | None = None
    # A session's turn, kept when the reply ends (Keeper.finish): its tokens (the prompt's and
    # the reply's); the expiries above then count its own.
    num_turn_tokens: int = 0

    @property
    def most_kept_tokens(self) -> int:
        return max(*self.num_kept_tokens, self.num_turn_tokens, 0)


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
    # With layer groups (cache/layer_groups.py): window_table[i] is block i's page in the window
    # layers' pool, -1 once it fell behind the window (blocks below window_floor hold none).
    window_table: list[int] = field(default_factory=list)
    window_floor: int = 0
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

    @property
    def first_run(self) -> bool:
        """Whether it runs for the first time (not after a preemption, no output yet): what the
        cache serves it then is the request's cache hit (num_cached_tokens)."""
        return self.num_preemptions == 0 and not self.output_token_ids

    @property
    def makes_cache_report(self) -> bool:
        """Whether admitting it makes its request's cache report: once per request, at its first
        sequence's first admission."""
        return self.index == 0 and self.first_run


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
