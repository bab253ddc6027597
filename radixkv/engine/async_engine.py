"""AsyncEngine: the bridge between an asyncio server and the (single-threaded) Engine.

One background thread owns the Engine: it applies queued commands (add, abort, calls) between
steps, steps while work exists and sleeps on a condition otherwise. Every Engine call happens
on that thread, so the Engine needs no lock; outputs travel back to each request's event loop
through `loop.call_soon_threadsafe` into an asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixkv.engine.engine import Engine
from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestDelta, merge_deltas
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.sessions import SessionRef
from radixkv.engine.stats import EngineStats
from radixkv.errors import InvalidRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

# When work exists but nothing could be scheduled (an impossible state in a healthy engine, but
# a loop must never spin on it), wait this long before trying again.
_NO_PROGRESS_WAIT_S = 0.01
# How long a stats read waits for the step in flight before it answers with the last snapshot.
_STATS_WAIT_S = 0.5


class EngineStopped(RuntimeError):
    """The engine thread has shut down (or died); the request cannot be served."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request; the original error is the __cause__."""


@dataclass(slots=True)
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    salt: str | None
    request_id: str
    stream: RequestStream
    future: concurrent.futures.Future[str]
    guide_grammar: Any = None  # params.guide, compiled before queuing (never on the engine thread)
    owner: str | None = None  # whose fair share of the batch it takes
    session: SessionRef | None = None  # the owner's session this turn continues
    sibling_salts: tuple[str | None, ...] = ()  # the owner's other partitions (cache reports)
    keeps: tuple[Keep, ...] = ()  # what stays cached once the prompt is computed


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


@dataclass(slots=True)
class _End:
    """Sentinel put on a stream's queue: the request ended without a finished output."""

    error: BaseException


class RequestStream:
    """Async iterator over one request's RequestDeltas; the last one is finished (and carries
    the whole output).

    A consumer that falls behind (a client that stops reading) holds only the deltas it has not
    taken yet, joined once when it next reads, never re-copied per step. `close()` aborts the
    request if it is still running; it is idempotent and safe to call from `finally` blocks,
    even while being cancelled.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._backlog: list[RequestDelta] = []  # delivered, not taken yet (consumer's loop only)
        self._end: _End | None = None
        self._ready = asyncio.Event()
        self._done = False  # the consumer has seen the end, or closed the stream
        self._ended = False  # the engine side has delivered the end (engine thread only)
        self._done_callbacks: list[Callable[[], None]] = []

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        while not self._backlog and self._end is None:
            self._ready.clear()
            await self._ready.wait()
        if self._end is not None:  # an error ends the stream; output it overtook is moot
            self._mark_done()
            raise self._end.error
        item = merge_deltas(self._backlog)
        self._backlog = []
        if item.finished:
            self._mark_done()
        return item

    @property
    def num_pending_tokens(self) -> int:
        """Tokens delivered but not taken yet (what a stalled consumer holds)."""
        return sum(len(c.token_ids) for delta in self._backlog for c in delta.completions)

    def _put(self, item: RequestDelta | _End) -> None:
        """On the consumer's loop: keep `item` until the consumer takes the backlog."""
        if isinstance(item, _End):
            self._end = item
        else:
            self._backlog.append(item)
        self._ready.set()

    @property
    def finished(self) -> bool:
        return self._done

    def close(self) -> None:
        if not self._done:
            self._mark_done()
            self._owner.abort(self.request_id)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the stream is done (its end seen, or closed); now if it is."""
        if self._done:
            callback()
        else:
            self._done_callbacks.append(callback)

    def _mark_done(self) -> None:
        self._done = True
        callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- engine thread side ------------------------------------------------------------------

    def _deliver(self, item: RequestDelta | _End) -> bool:
        """Hand an item to the consumer's loop; False when that loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop is closed: nobody will ever read this request
            return False
        return True


@dataclass(slots=True)
class _Shared:
    """State guarded by AsyncEngine._cond, shared by the engine thread and submitters."""

    commands: list[_Add | _Abort | _Call] = field(default_factory=list)
    closed: bool = False


class AsyncEngine:
    """Owns an Engine and the thread that steps it; see the module docstring."""

    def __init__(self, engine: Engine, *, start: bool = True) -> None:
        self.engine = engine
        self._persisted = False
        # Fixed after construction, so any thread may read them.
        self.tokenizer = engine.tokenizer
        self.max_context_tokens = engine.max_context_tokens
        self.context = engine.context  # frozen: a server checks lengths with it off this thread
        self._cond = threading.Condition()
        self._shared = _Shared()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._final_stats: EngineStats | None = None  # the engine's as its thread left it
        self._last_stats: EngineStats | None = None  # the last computed, for a read during a long step
        self.error: BaseException | None = None  # set when the engine thread died
        self._failed_steps_in_a_row = 0  # engine thread writes, anyone reads (an int: atomic)
        self._step_started_s: float | None = None  # time.monotonic() of the running step
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
        if start:
            self.start()

    @classmethod
    def build(cls, make_engine: Callable[[], Engine]) -> AsyncEngine:
        """Build the Engine on the thread that will step it, start stepping, return once built;
        make_engine's error is raised here.

        Why its own thread: libgomp keeps one pool of workers per thread that opens parallel
        regions, and once the pools' threads outnumber the cores it cuts spin-waiting at a
        barrier to about a thousand spins, so every barrier of a decode step sleeps on a futex.
        An engine loaded on the main thread and stepped on this one makes two pools; built here,
        the process has one (docs/measurements.md, "The server's per-token gap").
        """
        built: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()

        def build_then_run() -> None:
            try:
                async_engine = cls(make_engine(), start=False)
            except BaseException as error:  # noqa: BLE001 - the caller's to see
                built.set_exception(error)
                return
            async_engine._thread = thread
            built.set_result(async_engine)
            async_engine._run()

        thread = threading.Thread(target=build_then_run, name="radixkv-engine", daemon=True)
        thread.start()
        return built.result()

    def start(self) -> None:
        self._thread.start()

    # -- public API (any thread / event loop) ----------------------------------------------

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        request_id: str | None = None,
        owner: str | None = None,
        session: SessionRef | None = None,
        sibling_salts: tuple[str | None, ...] = (),
        keeps: tuple[Keep, ...] = (),
    ) -> RequestStream:
        """Queue a request; return its stream once the engine has accepted it (`keeps`:
        Engine.add_request's, reported on the stream's output).

        The Engine's own errors (InvalidRequest, QueueFull) are raised here, to the caller,
        before any output exists. Cancelling this await aborts the request. A JSON schema
        compiles for `owner` in a compile worker first, stopped at its deadline, so the engine
        thread never does (its CPU time waits in take_compile_cpu_s).
        """
        loop = asyncio.get_running_loop()
        grammar = await self.engine.guides.compile_async(params.guide, owner) if params.guide is not None else None
        request_id = request_id or f"{self._id_prefix}-{next(self._ids)}"
        stream = RequestStream(self, request_id, loop)
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._post(_Add(list(prompt_token_ids), params, salt, request_id, stream, future, grammar, owner, session=session, sibling_salts=sibling_salts, keeps=tuple(keeps)))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # ordered after the add, so it finds the request
            raise
        return stream

    def take_compile_cpu_s(self, owner: str | None) -> float:
        """CPU seconds `owner`'s guide compiles spent since the last call, for the caller to
        charge to the owner's share (reset by the call); from any thread."""
        return self.engine.guides.compiler.take_cpu_s(owner)

    def abort(self, request_id: str) -> None:
        """Abort a request between steps; its pages go back. Unknown or finished ids are ignored."""
        try:
            self._post(_Abort(request_id))
        except EngineStopped:
            pass  # everything was aborted at shutdown

    def abort_all(self) -> concurrent.futures.Future[int]:
        """Abort every request between steps (a drain past its deadline), each stream ending
        with its abort output as abort() does; resolves to how many there were."""

        def abort_every(_: Engine) -> int:
            request_ids = list(self._streams)  # on the engine thread, which owns _streams
            for request_id in request_ids:
                self._apply(_Abort(request_id))
            return len(request_ids)

        return self.call(abort_every)

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run fn(engine) on the engine thread between steps (introspection, checks)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(_Call(fn, future))
        return future

    async def call_async(self, fn: Callable[[Engine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def stats(self) -> EngineStats:
        """The engine's statistics now: computed on its thread between steps (so this waits
        for the step in flight; from an event loop, await stats_async), or read directly while
        no thread runs it; once the thread has stopped, as it left them."""
        if self._thread is threading.current_thread() or not self._thread.is_alive():
            return self._final_stats or self.engine.stats()
        future = self.call(lambda engine: engine.stats())
        try:
            return self._fresh_stats(future.result(timeout=_STATS_WAIT_S))
        except concurrent.futures.TimeoutError:
            # A long step is in flight: monitoring and routers' load polls answer now with the
            # last snapshot rather than wait for it (a stuck step is when they matter most).
            if self._last_stats is not None:
                return self._last_stats
            return self._fresh_stats(future.result())
        except EngineStopped:
            return self._stats_after_stop()

    async def stats_async(self) -> EngineStats:
        """stats(), awaited without holding up the event loop."""
        if not self._thread.is_alive():
            return self._final_stats or self.engine.stats()
        pending = asyncio.wrap_future(self.call(lambda engine: engine.stats()))
        try:
            return self._fresh_stats(await asyncio.wait_for(asyncio.shield(pending), _STATS_WAIT_S))
        except TimeoutError:
            if self._last_stats is not None:
                return self._last_stats  # as in stats(): a long step is in flight
            return self._fresh_stats(await pending)
        except EngineStopped:
            return await asyncio.to_thread(self._stats_after_stop)

    def _fresh_stats(self, stats: EngineStats) -> EngineStats:
        self._last_stats = stats
        return stats

    def num_unfinished(self) -> int:
        """Requests the engine holds, from any thread without waiting: one length read (atomic),
        as of the moment it is read."""
        return self.engine.num_unfinished

    def _stats_after_stop(self) -> EngineStats:
        # The thread is ending: it takes the final statistics after failing what was left.
        self._thread.join()
        return self._final_stats or self.engine.stats()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def unhealthy_reason(self) -> str | None:
        """Why the engine should not be sent work now (for /health), or None when it is fine:
        its thread is gone, its last steps all failed, or a step has run past the watchdog."""
        config = self.engine.config
        if not self.alive:
            return "the engine is not running"
        if self._failed_steps_in_a_row >= config.max_consecutive_failed_steps:
            return f"the engine's last {self._failed_steps_in_a_row} steps failed"
        started = self._step_started_s
        if started is not None and time.monotonic() - started > config.step_watchdog_s:
            return f"an engine step has run for more than {config.step_watchdog_s:g} s"
        return None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every request, stop the thread and wait for it; then write the RAM cache to
        the disk tier, if there is one (Engine.close), so the next start is warm."""
        with self._cond:
            self._shared.closed = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if not self._thread.is_alive() and not self._persisted:
            # Only once the thread is gone: the engine is single-threaded. (Without a disk
            # tier, close writes nothing.)
            self._persisted = True
            self.engine.close()
        if not self._thread.is_alive():
            self.engine.stop_kv_events()

    # -- engine thread ---------------------------------------------------------------------

    def _post(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            if self._shared.closed or self.error is not None:
                raise EngineStopped("the engine is shut down") from self.error
            self._shared.commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - anything here ends the service
            logger.exception("the engine thread died")
            with self._cond:
                self.error = error
                self._shared.closed = True
            self._fail_everything(EngineStopped(f"the engine thread died: {error!r}"))
        else:
            self._fail_everything(EngineStopped("the engine is shut down"))

    def _loop(self) -> None:
        idle_wait_s: float | None = None
        while True:
            with self._cond:
                if not self._shared.commands and not self._shared.closed and idle_wait_s != 0.0:
                    self._cond.wait(idle_wait_s)
                commands, self._shared.commands = self._shared.commands, []
                closed = self._shared.closed
            for command in commands:
                self._apply(command)
            if closed:
                return
            idle_wait_s = None
            if self.engine.has_unfinished():
                steps_before = self.engine.counters.num_steps
                self._step_started_s = time.monotonic()
                try:
                    outputs = self.engine.step()
                    self._failed_steps_in_a_row = 0
                except Exception as error:  # noqa: BLE001 - fail the batch, keep serving
                    self._failed_steps_in_a_row += 1
                    logger.exception("engine step failed; aborting every running request")
                    self._fail_running(error)
                    outputs = []
                finally:
                    self._step_started_s = None
                for output in outputs:
                    self._dispatch(output)
                for request_id, error in self.engine.take_failed():
                    # A request's own input (a schema with no way on) is the client's error, not the engine's.
                    level = logging.INFO if isinstance(error, InvalidRequest) else logging.ERROR
                    logger.log(level, "request %s failed alone in a step: %r", request_id, error)
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream._deliver(_End(_step_error(error)))
                if self.engine.has_unfinished():
                    progressed = self.engine.counters.num_steps != steps_before
                    idle_wait_s = 0.0 if progressed else _NO_PROGRESS_WAIT_S

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            if not command.future.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(
                    command.prompt_token_ids,
                    command.params,
                    salt=command.salt,
                    request_id=command.request_id,
                    guide_grammar=command.guide_grammar,
                    owner=command.owner,
                    session=command.session,
                    sibling_salts=command.sibling_salts,
                    keeps=command.keeps,
                )
            except Exception as error:  # noqa: BLE001 - InvalidRequest, QueueFull: the caller's to handle
                command.future.set_exception(error)
                return
            self._streams[command.request_id] = command.stream
            command.future.set_result(command.request_id)
        elif isinstance(command, _Abort):
            stream = self._streams.pop(command.request_id, None)
            try:
                output = self.engine.abort(command.request_id)
            except Exception as error:  # noqa: BLE001 - one failed abort must not end the service
                logger.exception("abort of %s failed", command.request_id)
                output = _End(_step_error(error))
            if stream is not None and output is not None:
                stream._deliver(output)
        elif command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except BaseException as error:  # noqa: BLE001 - the caller's to see
                command.future.set_exception(error)

    def _dispatch(self, output: RequestDelta) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if not stream._deliver(output) and not output.finished:
            del self._streams[output.request_id]
            self._abort_quietly(output.request_id)

    def _fail_running(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self._abort_quietly(request_id)
            del self._streams[request_id]
            stream._deliver(_End(_step_error(error)))

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - logged; the engine thread keeps serving the rest
            logger.exception("abort of %s failed", request_id)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            commands, self._shared.commands = self._shared.commands, []
        for command in commands:
            if isinstance(command, (_Add, _Call)) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort while going down
                logger.exception("abort of %s failed at shutdown", request_id)
            stream._deliver(_End(error))
        self._streams.clear()
        self._final_stats = self.engine.stats()


def _step_error(error: BaseException) -> EngineStepError:
    wrapped = EngineStepError(f"the engine failed while running this request: {error!r}")
    wrapped.__cause__ = error
    return wrapped
