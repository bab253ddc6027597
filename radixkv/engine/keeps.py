"""Keeps: what a request asks to stay cached, applied once, right after the step that computed its
prompt, through KVManager's retain (unlocked) and the pins (locked), under the owner's caps.
The report it makes is the only source of the wire's cache-write usage fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixkv.engine.kv_manager import KVManager
from radixkv.engine.pins import Pins
from radixkv.engine.request import MAX_KEEPS, Keep, KeepReport, SequenceState
from radixkv.errors import InvalidRequest


def check_keeps(keeps: Sequence[Keep], num_prompt_tokens: int) -> tuple[Keep, ...]:
    """The keeps as a tuple; InvalidRequest (param "keeps", the limit as data) for more than
    MAX_KEEPS, a keep that is no Keep, or one past the prompt or with a lifetime it may not have."""
    keeps = tuple(keeps)
    if len(keeps) > MAX_KEEPS:
        raise InvalidRequest(f"a request may keep at most {MAX_KEEPS} prefixes, got {len(keeps)}", param="keeps", limit=MAX_KEEPS)
    for keep in keeps:
        if not isinstance(keep, Keep):
            raise InvalidRequest(f"keeps must be Keep records, got {type(keep).__name__}", param="keeps")
        keep.check(num_prompt_tokens)
    return keeps


class Keeper:
    """Applies a request's keeps when its prompt is computed. Unlocked keeps retain (the owner's
    retention cap, EngineConfig.max_retained_pages_per_owner, and the tree's cap over all
    owners may trim them); a locked keep pins (Pins: per owner and over all owners), and a pin
    the caps refuse is reported, not raised, so the request itself runs on. Engine thread only."""

    def __init__(self, kv: KVManager, pins: Pins, max_retained_pages_per_owner: int, clock: Callable[[], float]) -> None:
        self._kv = kv
        self._pins = pins
        self._max_retained_pages_per_owner = max_retained_pages_per_owner
        self._clock = clock

    def due(self, seq: SequenceState) -> bool:
        """Whether seq's keeps are to be applied now: it has some, its request has not applied
        them, and its whole prompt is computed (and committed); pure."""
        return bool(seq.keeps) and seq.kept is None and seq.num_computed_tokens >= len(seq.prompt_token_ids)

    def apply(self, seq: SequenceState, num_cached_tokens: int) -> KeepReport:
        """Retain or pin each of seq's keeps, in order; the report (`num_cached_tokens`: what the
        cache served the request, so the rest of the most kept was written by it)."""
        kept: list[int] = []
        expiries: list[float] = []
        pin = error = None
        prompt = seq.prompt_token_ids
        for keep in seq.keeps:
            prefix = prompt[: keep.num_tokens]
            if keep.lock:
                try:
                    pin = self._pins.pin(prefix, seq.salt, seq.owner, keep.ttl_s)
                except InvalidRequest as refused:
                    error, pin = refused, None
                    kept.append(0)
                    continue
                kept.append(pin.num_pinned_tokens)
                if pin.expires_at_s is not None:
                    expiries.append(pin.expires_at_s)
                continue
            assert keep.ttl_s is not None, "Keep.check refuses an unlocked keep without a ttl"
            num = self._kv.retain(prefix, seq.salt, float(keep.ttl_s), seq.owner, self._max_retained_pages_per_owner) if prefix else 0
            kept.append(num)
            if num:
                expiries.append(self._clock() + keep.ttl_s)
        most = max(kept, default=0)
        return KeepReport(tuple(kept), max(0, most - num_cached_tokens), max(expiries, default=None), pin, error)
