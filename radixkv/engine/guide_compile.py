"""Where guides compile: worker processes, killed at the compile deadline (xgrammar compiles in
C++ and cannot be interrupted on a thread), fed from per-owner queues served in turn, at most one
compile per owner at once and a bounded wait past it (`CompileQueues`).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Seconds a worker may take to start (it imports xgrammar, and with it torch, and reads the
# vocabulary): never counted against a compile, which starts only once its worker is ready.
WORKER_START_TIMEOUT_S = 120.0
# Past the compile and mask budgets, what serializing the compiled grammar and sending it back
# may take before the worker is killed.
TRANSFER_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class CompileJob:
    """One guide to compile: its kind ("json", "regex", "ebnf"), its text, strict (JSON)."""

    kind: str
    text: str
    strict: bool


@dataclass(frozen=True, slots=True)
class Compiled:
    """A worker's compiled guide, serialized (xgrammar's CompiledGrammar.serialize_json), with
    what it cost and its first token mask (int32 bytes) for the caller to check."""

    grammar_json: str
    compile_s: float
    mask_s: float
    first_mask: bytes
    cpu_s: float


@dataclass(frozen=True, slots=True)
class NotCompiled:
    """xgrammar refused the guide; `message` is its first line."""

    message: str
    cpu_s: float


@dataclass(frozen=True, slots=True)
class Killed:
    """The worker ran past the deadline and was killed (`died`: it ended by itself first).
    With one compile thread per worker, its CPU time is at most the wall time it ran."""

    cpu_s: float
    died: bool = False


Outcome = Compiled | NotCompiled | Killed


class CompileQueues(Generic[T]):
    """Compiles waiting, per owner: at most one owner's compile runs at once, owners are served
    in turn, and each owner may have `max_queued` more waiting (`put` says False past that).
    Thread-safe; `take` blocks until an owner with nothing running has one waiting."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str | None, deque[T]] = OrderedDict()
        self._running: set[str | None] = set()
        self._idle_takers = 0

    def put(self, owner: str | None, item: T) -> bool:
        with self._cond:
            queue = self._waiting.setdefault(owner, deque())
            if len(queue) >= self.max_queued:
                if not queue:
                    del self._waiting[owner]
                return False
            queue.append(item)
            self._cond.notify_all()
            return True

    def take(self) -> tuple[str | None, T]:
        """The next owner's oldest compile, marking the owner running until `done`."""
        with self._cond:
            self._idle_takers += 1
            try:
                while not (runnable := self._runnable()):
                    self._cond.wait()
            finally:
                self._idle_takers -= 1
            owner = runnable[0]
            queue = self._waiting.pop(owner)
            item = queue.popleft()
            if queue:
                self._waiting[owner] = queue  # to the end of the line: owners take turns
            self._running.add(owner)
            return owner, item

    def done(self, owner: str | None) -> None:
        with self._cond:
            self._running.discard(owner)
            self._cond.notify_all()

    def state(self, owner: str | None) -> tuple[int, int]:
        """(compiles running, compiles waiting) of `owner`; changes nothing."""
        with self._cond:
            return int(owner in self._running), len(self._waiting.get(owner, ()))

    @property
    def idle_takers(self) -> int:
        with self._cond:
            return self._idle_takers

    def _runnable(self) -> list[str | None]:
        """The first owner in line with nothing running, as a list (None is an owner)."""
        return [owner for owner in self._waiting if owner not in self._running][:1]


class CompileWorker:
    """One worker process, started on first use and again after a kill; runs one job at a time
    for the thread that owns it. `target(conn, *args())` is the process's body (`worker_main`)."""

    def __init__(self, target: Callable[..., None], args: Callable[[], tuple[Any, ...]]) -> None:
        self._target = target
        self._args = args
        self._process: Any = None
        self._conn: Connection | None = None
        self.starts = 0
        self.kills = 0

    def run(self, job: CompileJob, deadline_s: float) -> Outcome:
        """The job's outcome; the clock starts when the job is sent to a ready worker."""
        conn = self._started()
        start_s = time.perf_counter()
        conn.send(job)
        if conn.poll(deadline_s):
            try:
                return conn.recv()
            except (EOFError, OSError):
                self.stop()
                return Killed(time.perf_counter() - start_s, died=True)
        self.stop()
        self.kills += 1
        return Killed(time.perf_counter() - start_s)

    def stop(self) -> None:
        """Kill the process, if any; the next job starts another."""
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if process is not None:
            process.kill()
            process.join()
        if conn is not None:
            conn.close()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _started(self) -> Connection:
        if self._conn is not None and self.alive:
            return self._conn
        self.stop()
        context = _worker_context()
        conn, child_conn = context.Pipe()
        process = context.Process(target=self._target, args=(child_conn, *self._args()), name="radixkv-guide-compile", daemon=True)
        process.start()
        child_conn.close()
        self._process, self._conn = process, conn
        self.starts += 1
        if not conn.poll(WORKER_START_TIMEOUT_S) or conn.recv() != "ready":
            self.stop()
            raise RuntimeError(f"the grammar compile worker did not start within {WORKER_START_TIMEOUT_S:g} s")
        return conn


def _worker_context() -> Any:
    """forkserver, with xgrammar (and torch) imported there once: a worker, first or after a
    kill, is a fork of that quiet single-threaded process rather than a fresh interpreter
    importing torch; never a fork of this one, whose threads (and OpenMP pool) it would copy
    mid-use. Spawn where forkserver is not offered."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["xgrammar", __name__])
    return context


def serve(conn: Connection, run: Callable[[CompileJob], Outcome]) -> None:
    """A worker's loop: say ready, then answer each job until the parent closes the pipe."""
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(run(job))


def worker_main(conn: Connection, tokenizer_info_json: str, vocab_size: int) -> None:
    """A worker process's body: one xgrammar compiler over the model's vocabulary."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    # One thread: a compile's CPU time is then its wall time at most, which is what a killed
    # one is charged; the parent caches, so xgrammar's own cache would only hold memory.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    serve(conn, lambda job: compile_job(compiler, job, vocab_size))


def compile_job(compiler: Any, job: CompileJob, vocab_size: int) -> Compiled | NotCompiled:
    """Compile one job and fill its first token mask, timing both (in the worker)."""
    import xgrammar

    start_cpu_s = time.process_time()
    start_s = time.perf_counter()
    try:
        if job.kind == "regex":
            grammar = compiler.compile_regex(job.text)
        elif job.kind == "ebnf":
            grammar = compiler.compile_grammar(job.text)
        else:
            grammar = compiler.compile_json_schema(job.text, any_whitespace=False, separators=(",", ":"), strict_mode=job.strict)
    except (RuntimeError, ValueError, TypeError) as error:
        return NotCompiled(_first_line(error), time.process_time() - start_cpu_s)
    compile_s = time.perf_counter() - start_s
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    start_s = time.perf_counter()
    matcher.fill_next_token_bitmask(bitmask)
    mask_s = time.perf_counter() - start_s
    grammar_json = grammar.serialize_json()
    return Compiled(grammar_json, compile_s, mask_s, bitmask.numpy().tobytes(), time.process_time() - start_cpu_s)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
