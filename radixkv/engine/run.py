"""Running a list of prompts on an Engine until every one has ended: the loop under `LLM` and
the SDK's in-process backend. Prompts enter in order as the waiting queue has room; an error or
interrupt aborts whatever is still running, so no request is left holding pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from radixkv.engine.engine import Engine
from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.errors import InvalidRequest, QueueFull

OnFinished = Callable[[int, RequestOutput], None]
OnRejected = Callable[[int, InvalidRequest | QueueFull], None]


def run_to_completion(
    engine: Engine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    salt: str | None = None,
    on_finished: OnFinished,
    on_rejected: OnRejected | None = None,
    on_step: Callable[[Engine], None] | None = None,
    session: SessionRef | None = None,
    keeps: Sequence[tuple[Keep, ...]] | None = None,
) -> None:
    """Run prompts[i] with params[i] (and keeps[i], engine/keeps.py); on_finished(i, output) as each ends. A prompt the engine
    refuses goes to on_rejected(i, error), or raises where there is none (nothing of it runs).
    on_step(engine) runs after every step (introspection, tests). With `session`, every
    prompt is a turn of that session (engine/sessions.py)."""
    pending = deque(range(len(prompts)))
    running: dict[str, int] = {}
    try:
        while pending or running:
            while pending and engine.queue_room() >= params[pending[0]].n:
                i = pending.popleft()
                try:
                    running[engine.add_request(prompts[i], params[i], salt=salt, session=session, keeps=keeps[i] if keeps else ())] = i
                except InvalidRequest as error:
                    _reject(on_rejected, i, error)
            if pending and params[pending[0]].n > engine.config.max_queue_len:
                n = params[pending[0]].n
                limit = engine.config.max_queue_len
                _reject(on_rejected, pending.popleft(), QueueFull(f"n={n} is more than the waiting queue holds ({limit})", limit=limit))
                continue
            for delta in engine.step():
                i = running.pop(delta.request_id, None) if delta.finished else None
                if i is not None:
                    on_finished(i, delta.output)  # type: ignore[arg-type]
            for request_id, error in engine.take_failed():
                if running.pop(request_id, None) is not None:
                    raise error  # as a failed step would: the caller sees why, the rest are aborted
            if on_step is not None:
                on_step(engine)
    finally:
        for request_id in running:
            engine.abort(request_id)


def _reject(on_rejected: OnRejected | None, i: int, error: InvalidRequest | QueueFull) -> None:
    if on_rejected is None:
        raise error
    on_rejected(i, error)
