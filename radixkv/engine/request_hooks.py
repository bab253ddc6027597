"""What the engine tells about a request beyond running it: its session (the turn checked, begun,
dropped) and, under the `predict` eviction policy, the dead-block predictor (begun, finished,
dropped). `Engine` calls these at add, step, abort and failure, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from radixkv.config import EngineConfig
from radixkv.engine.predicted_liveness import PredictedLiveness
from radixkv.engine.sessions import SessionBook, SessionLimits, SessionRef

if TYPE_CHECKING:
    from radixkv.cache.hashing import BlockHasher
    from radixkv.cache.radix import RadixTree
    from radixkv.engine.kv_manager import KVManager
    from radixkv.engine.request import Keep, SequenceState
    from radixkv.engine.request_output import RequestDelta


class RequestHooks:
    """The session book and the predictor, built from the config, told of each request's life."""

    def __init__(self, config: EngineConfig, kv: KVManager, tree: RadixTree, hasher: BlockHasher, clock: Callable[[], float]) -> None:
        # Under `predict`, finished requests teach the dead-block predictor, and a session's
        # release (DELETE) tells it that session's tail is dead.
        self.predicted: PredictedLiveness | None = None
        if config.eviction_policy == "predict":
            self.predicted = PredictedLiveness(kv, tree, hasher, clock)
        # Sessions name conversations; each turn is a keep into the reply (no lock).
        self.sessions = SessionBook(
            kv, tree, SessionLimits.of(config), chunk_tokens=config.max_batch_tokens, clock=clock,
            signals=kv, released=self.predicted.released if self.predicted is not None else None,
        )  # fmt: skip

    def check(self, session: SessionRef | None, num_prompt_tokens: int) -> Keep | None:
        """The turn's keep into the reply, checked against the session's caps before any work
        (InvalidRequest past one); None without a session."""
        return self.sessions.check(session, num_prompt_tokens) if session is not None else None

    def begin(self, request_id: str, salt: str | None, session: SessionRef | None, turn: Keep | None, seqs: list[SequenceState]) -> None:
        if session is not None and turn is not None:
            self.sessions.begin(request_id, session, turn, salt, seqs)
        if self.predicted is not None:
            self.predicted.begin(request_id, salt, session)

    def finished(self, deltas: Sequence[RequestDelta]) -> None:
        """The step's ended requests teach the predictor (the book keeps a turn as it ends)."""
        if self.predicted is not None:
            for delta in deltas:
                if delta.output is not None:
                    self.predicted.finished(delta.output)

    def dropped(self, request_id: str) -> None:
        """The request ended without finishing (aborted, or its step failed it)."""
        self.sessions.dropped(request_id)
        if self.predicted is not None:
            self.predicted.dropped(request_id)

    def expire(self) -> int:
        """Sessions idle past their time end; how many."""
        return self.sessions.expire() if self.sessions else 0
