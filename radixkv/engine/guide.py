"""Constrained decoding: compiles a guide (a `JsonGuide`'s JSON schema, a `GrammarGuide`'s regex
or EBNF grammar) with xgrammar (in worker processes, engine/guide_compile.py; grammars cached per
owner by their text), keeps one matcher per guided sequence, and fills their next-token bitmasks on worker threads while the
model forward runs.

Why xgrammar rather than llguidance (`radixkv bench guided_decoding`; figures in
docs/measurements.md): a step's mask costs far less, and that is paid on every token, while
xgrammar's slower compile is paid once per schema.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

# xgrammar is imported where it is first needed: importing it takes about as long as importing
# torch, and an engine that never sees a guide should not pay for it.
from radixkv.cpu.logits import apply_token_bitmask
from radixkv.engine.guide_compile import TRANSFER_GRACE_S, CompileJob, CompileQueues, CompileWorker, Killed, NotCompiled, Outcome, worker_main
from radixkv.engine.pins import Owner
from radixkv.engine.request import SequenceState
from radixkv.engine.sampling_params import GrammarGuide, Guide, JsonGuide
from radixkv.errors import InvalidRequest, OwnerCapExceeded

# (kind: "json", "regex" or "ebnf"; its text, None for any JSON object; strict, for JSON)
GuideKey = tuple[str, str | None, bool]
# A compiled grammar is cached, and a too-slow verdict remembered, per owner: another owner's
# entry is never hit, so no caller can time whether another sent a schema.
CacheKey = tuple[Owner, GuideKey]


@dataclass(frozen=True, slots=True)
class GuideLimits:
    """What one schema may cost before it is refused (InvalidRequest, param response_format):
    its text, its nesting, a grammar's rules, its compile and its first token mask (a proxy for
    every later one); and how many compiles one owner may have waiting (OwnerCapExceeded)."""

    max_schema_bytes: int = 128 << 10
    max_schema_depth: int = 64
    compile_timeout_s: float = 10.0
    mask_timeout_s: float = 0.25
    max_grammar_rules: int = 512
    max_queued_compiles_per_owner: int = 4


class GuideRejected(RuntimeError):
    """A guided sequence's matcher refused the token sampled for it: the row fails alone."""

MAX_CACHED_GRAMMARS = 256
# Schemas refused for being too slow, remembered so a resent one costs nothing.
MAX_REMEMBERED_SLOW = 1024
# Compile worker processes: two keep one slow schema from holding every compile while leaving
# the forward its cores; an owner runs one compile at a time, so one owner holds one at most.
COMPILE_WORKERS = 2
# Threads xgrammar fills a step's rows with: enough to spread a large batch, few enough to
# leave the forward its cores.
MAX_FILL_THREADS = 4
# "Any JSON object": strict would forbid every property of a schema that names none.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class _Pending:
    key: CacheKey
    job: CompileJob
    future: Future[Any]


class GuideCompiler:
    """Compiles guides for one tokenizer; the vocabulary is the model's logits width (it may
    exceed the tokenizer's), and the engine's EOS ids are the tokens that end a grammar.

    Compiles run in worker processes (engine/guide_compile.py), each owner's one at a time and
    owners in turn, killed at the compile deadline; the clock runs from the job's start in a
    ready worker, never while it waits. Thread-safe: the server compiles a request's schema
    before queuing it (`submit`), so the engine thread only finds it cached; in-process callers
    `compile`. The compile CPU time each owner spent waits in `take_cpu_s` for its charging."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: GuideLimits | None = None,
        worker_target: Callable[..., None] = worker_main,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.limits = limits or GuideLimits()
        self.info: Any = None  # xgrammar's TokenizerInfo, built on first use: an unguided engine never pays for it
        self.no_control_bytes: torch.Tensor | None = None  # with the info; see _control_free_bitmask
        self.compiles = 0  # compiles a worker ran to an outcome (tests count them)
        self._lock = threading.Lock()  # guards the maps below and the info's creation
        self._grammars: OrderedDict[CacheKey, Any] = OrderedDict()
        self._in_flight: dict[CacheKey, Future[Any]] = {}
        self._too_slow: OrderedDict[CacheKey, str] = OrderedDict()  # key -> why it was refused
        self._cpu_s: dict[Owner, float] = {}
        self.queues: CompileQueues[_Pending] = CompileQueues(self.limits.max_queued_compiles_per_owner)
        self.workers: list[CompileWorker] = []
        self._worker_target = worker_target

    def submit(self, guide: Guide, owner: Owner = None) -> Future[Any]:
        """The guide's compiled grammar as a future (done at once when `owner` has it cached);
        from any thread. The future raises InvalidRequest(param="response_format") for a schema
        that is not JSON Schema xgrammar accepts, is over the limits, or leaves no first token,
        and OwnerCapExceeded when `owner` already has its limit of compiles waiting."""
        key = (owner, _key(guide))
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return _done(grammar)
            if key in self._too_slow:
                return _failed(_too_complex(self._too_slow[key]))
            future = self._in_flight.get(key)
            if future is not None:
                return future
            try:
                text = _checked_schema_text(guide.schema, self.limits) if isinstance(guide, JsonGuide) else _checked_grammar_text(guide, self.limits)
            except InvalidRequest as error:
                return _failed(error)
            future = Future()
            if not self.queues.put(owner, _Pending(key, CompileJob(key[1][0], text, key[1][2]), future)):
                return _failed(self._queue_full())
            self._in_flight[key] = future
            self._start_worker()
        return future

    def compile(self, guide: Guide, owner: Owner = None) -> Any:
        """The guide's compiled grammar: waits for its turn and its compile, which is stopped
        at the compile deadline."""
        return self.submit(guide, owner).result()

    def take_cpu_s(self, owner: Owner) -> float:
        """The CPU seconds `owner`'s compiles spent since the last call (killed ones count their
        time to the kill): for the caller to charge to the owner's share; resets them."""
        with self._lock:
            return self._cpu_s.pop(owner, 0.0)

    def close(self) -> None:
        """Stop the worker processes; a later compile starts them again."""
        for worker in self.workers:
            worker.stop()

    def _queue_full(self) -> OwnerCapExceeded:
        limit = self.queues.max_queued
        return OwnerCapExceeded(
            f"this caller already has {limit} grammar compiles waiting; one compiles at a time per caller and "
            f"{limit} may wait; retry later",
            param="response_format", code="compile_queue_full", limit=limit,
        )  # fmt: skip

    def _start_worker(self) -> None:
        """One more worker and its thread while every thread is busy (under the lock)."""
        if len(self.workers) >= COMPILE_WORKERS or self.queues.idle_takers:
            return
        worker = CompileWorker(self._worker_target, self._worker_args)
        self.workers.append(worker)
        threading.Thread(target=self._serve, args=(worker,), name="radixkv-guide-compile", daemon=True).start()

    def _serve(self, worker: CompileWorker) -> None:
        while True:
            owner, pending = self.queues.take()
            try:
                outcome = worker.run(pending.job, self._deadline_s())
            except BaseException as error:  # noqa: BLE001 - the worker would not start: the waiter's to see
                self._settle(pending, error)
            else:
                self._charge(owner, outcome.cpu_s)
                try:
                    self._settle(pending, self._grammar_of(pending.key, outcome))
                except InvalidRequest as error:
                    self._settle(pending, error)
            finally:
                self.queues.done(owner)

    def _deadline_s(self) -> float:
        return self.limits.compile_timeout_s + self.limits.mask_timeout_s + TRANSFER_GRACE_S

    def _worker_args(self) -> tuple[str, int]:
        return self._tokenizer_info().serialize_json(), self.vocab_size

    def _charge(self, owner: Owner, cpu_s: float) -> None:
        with self._lock:
            self.compiles += 1
            self._cpu_s[owner] = self._cpu_s.get(owner, 0.0) + cpu_s

    def _settle(self, pending: _Pending, result: Any) -> None:
        """Out of flight, cached when compiled, and the waiters told; at once, under the lock, so
        no second compile slips between."""
        with self._lock:
            self._in_flight.pop(pending.key, None)
            if not isinstance(result, BaseException):
                self._grammars[pending.key] = result
                if len(self._grammars) > MAX_CACHED_GRAMMARS:
                    self._grammars.popitem(last=False)
        if isinstance(result, BaseException):
            pending.future.set_exception(result)
        else:
            pending.future.set_result(result)

    def _grammar_of(self, key: CacheKey, outcome: Outcome) -> Any:
        """The compiled grammar of a worker's outcome, or the InvalidRequest it earns. Only a
        guide's own compile or mask past its budget is remembered as too slow."""
        what, limits = _what(key[1]), self.limits
        if isinstance(outcome, Killed):
            if outcome.died:
                raise InvalidRequest(f"{what} could not be compiled: the compile worker stopped", param="response_format")
            raise self._slow(key, f"{what} took longer than {limits.compile_timeout_s:g} s to compile; simplify it")
        if isinstance(outcome, NotCompiled):
            raise InvalidRequest(f"{what} cannot be compiled: {outcome.message}", param="response_format")
        if outcome.compile_s > limits.compile_timeout_s:
            raise self._slow(key, f"{what} took {outcome.compile_s:.1f} s to compile, over the {limits.compile_timeout_s:g} s limit; simplify it")
        if outcome.mask_s > limits.mask_timeout_s:
            raise self._slow(key, f"{what}'s token mask took {outcome.mask_s * 1e3:.0f} ms, over the {limits.mask_timeout_s * 1e3:.0f} ms limit; simplify it")
        import xgrammar

        grammar = xgrammar.CompiledGrammar.deserialize_json(outcome.grammar_json, self._tokenizer_info())
        self._check_first_mask(key[1], outcome.first_mask)
        return grammar

    def _check_first_mask(self, key: GuideKey, first_mask: bytes) -> None:
        """A guide whose first mask (filled in the worker) allows no token can never start."""
        assert self.no_control_bytes is not None  # built with the info
        bitmask = torch.frombuffer(bytearray(first_mask), dtype=torch.int32).view(1, -1)
        if not bool(bitmask.bitwise_and_(self.no_control_bytes).any()):
            raise InvalidRequest(f"{_what(key)} allows no token this model can start with", param="response_format", code="schema_unsatisfiable")

    def _slow(self, key: CacheKey, message: str) -> InvalidRequest:
        """The refusal of a schema too slow to compile or mask, remembered for its owner's next time."""
        with self._lock:
            self._too_slow[key] = message
            if len(self._too_slow) > MAX_REMEMBERED_SLOW:
                self._too_slow.popitem(last=False)
        return _too_complex(message)

    def _tokenizer_info(self) -> Any:
        with self._lock:
            if self.info is None:
                import xgrammar

                self.info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self.no_control_bytes = _control_free_bitmask(self.info, self.vocab_size)
            return self.info


def _too_complex(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="response_format", code="schema_too_complex")


def _key(guide: Guide) -> GuideKey:
    if isinstance(guide, GrammarGuide):
        return (guide.kind, guide.source, False)
    return ("json", guide.schema, guide.strict if guide.schema is not None else False)


def _what(key: GuideKey) -> str:
    """How a message names the guide: the JSON schema, the regex, the grammar."""
    return {"regex": "the regex", "ebnf": "the grammar"}.get(key[0], "the JSON schema")


def _checked_grammar_text(guide: GrammarGuide, limits: GuideLimits) -> str:
    """A regex's or grammar's text, refused early past the size limit (a schema's), the nesting
    limit (its parentheses, as a schema's depth) and, for a grammar, the rule limit: a
    compile's work grows with each."""
    what, text = _what(_key(guide)), guide.source
    size = len(text.encode())
    if size > limits.max_schema_bytes:
        raise InvalidRequest(f"{what} has {size} bytes; the limit is {limits.max_schema_bytes}", param="response_format", limit=limits.max_schema_bytes)
    if _paren_depth(text) > limits.max_schema_depth:
        raise InvalidRequest(f"{what} nests deeper than {limits.max_schema_depth} levels", param="response_format", limit=limits.max_schema_depth)
    rules = text.count("::=") if guide.kind == "ebnf" else 0
    if rules > limits.max_grammar_rules:
        raise InvalidRequest(f"{what} has {rules} rules; the limit is {limits.max_grammar_rules}", param="response_format", limit=limits.max_grammar_rules)
    return text


def _paren_depth(text: str) -> int:
    """How deep parentheses nest in a regex or grammar (quoted or escaped ones count too: an
    over-count refuses only texts already near the limit)."""
    depth = deepest = 0
    for char in text:
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


def _control_free_bitmask(info: Any, vocab_size: int) -> torch.Tensor:
    """int32 [1, ceil(vocab / 32)]: every token except those holding a raw control byte.

    Compact JSON has no place for one (no whitespace between tokens; inside strings they must be
    escaped), yet xgrammar 0.2.9 lets them into strings with a maxLength, and strict parsers
    then refuse the text. Masking them as well keeps every guided output parseable.
    """
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    stop_ids = set(info.stop_token_ids)
    for token_id, piece in enumerate(info.decoded_vocab):
        if token_id not in stop_ids and any(byte < 0x20 for byte in piece):
            bitmask[0, token_id // 32] &= ~(1 << (token_id % 32))
    return bitmask


def _checked_schema_text(schema: str | None, limits: GuideLimits) -> str:
    """The schema text to compile, refused early when it is not JSON, not a schema object, or
    over the size and nesting limits (xgrammar's own messages for those are less clear, and
    its compile time grows with both)."""
    if schema is None:
        return ANY_OBJECT_SCHEMA
    if not isinstance(schema, str):
        raise InvalidRequest(f"the JSON schema must be JSON text, got {type(schema).__name__}", param="response_format")
    size = len(schema.encode())
    if size > limits.max_schema_bytes:
        raise InvalidRequest(
            f"the JSON schema has {size} bytes; the limit is {limits.max_schema_bytes}", param="response_format", limit=limits.max_schema_bytes
        )
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"the JSON schema is not valid JSON: {error}", param="response_format") from error
    except RecursionError:  # nested past the parser's stack: past any depth limit too
        parsed = None
        depth = limits.max_schema_depth + 1
    else:
        depth = _json_depth(parsed)
    if depth > limits.max_schema_depth:
        raise InvalidRequest(
            f"the JSON schema nests deeper than {limits.max_schema_depth} levels", param="response_format", limit=limits.max_schema_depth
        )
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"a JSON schema must be a JSON object, got {type(parsed).__name__}", param="response_format")
    return json.dumps(bounded_numbers(parsed)) if _has_unbounded_number(parsed) else schema


# What JSON parsers read back: a 64-bit integer, and for a number a double's exact integers
# (JavaScript's JSON.parse included). Without a bound the grammar lets a reply run to max_tokens
# in digits; xgrammar compiles a range into a grammar with a bounded count of digits.
INTEGER_RANGE = (-(1 << 63), (1 << 63) - 1)
NUMBER_RANGE = (-(1 << 53), 1 << 53)
# Keys whose values are data, not schemas: a bound is never added inside them.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def _schema_nodes(schema: dict) -> Iterator[dict]:
    """Every object in a schema that may be a (sub)schema, without recursion."""
    stack: list[object] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(value for key, value in node.items() if key not in _DATA_KEYS)
        elif isinstance(node, list):
            stack.extend(node)


def _numeric_types(node: dict) -> set[str]:
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    return kinds & {"integer", "number"}


def _unbounded(node: dict) -> bool:
    return bool(_numeric_types(node)) and not ({"minimum", "exclusiveMinimum"} & node.keys() and {"maximum", "exclusiveMaximum"} & node.keys())


def _has_unbounded_number(schema: dict) -> bool:
    return any(_unbounded(node) for node in _schema_nodes(schema))


def bounded_numbers(schema: dict) -> dict:
    """The schema with every integer or number that lacks a bound given one (INTEGER_RANGE,
    NUMBER_RANGE; a number-or-integer takes the number's): changes `schema` in place."""
    for node in _schema_nodes(schema):
        if _unbounded(node):
            low, high = NUMBER_RANGE if "number" in _numeric_types(node) else INTEGER_RANGE
            if not {"minimum", "exclusiveMinimum"} & node.keys():
                node["minimum"] = low
            if not {"maximum", "exclusiveMaximum"} & node.keys():
                node["maximum"] = high
    return schema


def _json_depth(value: object) -> int:
    """How deep objects and arrays nest in a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


class GuideState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, grammar: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(grammar)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; True once the grammar is complete."""
        if not self.matcher.accept_token(token):
            # The sampler drew from the masked row, so only an engine bug gets here; the row's
            # request fails alone, the batch goes on.
            raise GuideRejected(f"token {token} was sampled outside the grammar")
        return self.matcher.is_terminated()


@dataclass(slots=True)
class GuideMasks:
    """The bitmasks of one step's guided sampling rows, to apply to the logits before sampling."""

    rows: list[int]  # the sampling rows that have a guide
    bitmask: torch.Tensor  # int32 [sampling rows, ceil(vocab / 32)]; only `rows` are filled

    def take_dead_rows(self) -> list[int]:
        """The guided rows whose grammar allows no token at all (a pattern only control bytes
        could continue): opened to every token so the batch still samples, for the caller to
        fail alone."""
        dead = [row for row, alive in zip(self.rows, self.bitmask[self.rows].any(dim=-1).tolist()) if not alive]
        for row in dead:
            self.bitmask[row].fill_(-1)
        return dead

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens of the guided rows to -inf, in place: by the native kernel for fp32
        logits on CPU (radixkv/cpu/csrc/logits.c, ~20x xgrammar's CPU apply), else xgrammar."""
        if apply_token_bitmask(logits, self.bitmask, self.rows):
            return
        import xgrammar

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)


@dataclass(slots=True)
class PendingMasks:
    """A step's bitmask fill, running on the fill thread; `join` waits for it."""

    masks: GuideMasks
    future: Future[None]

    def join(self) -> GuideMasks:
        self.future.result()
        return self.masks


class Guides:
    """The engine's guided decoding: checks and compiles guides, gives each guided sequence its
    matcher, and fills a step's masks beside the forward."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: GuideLimits | None = None) -> None:
        self.compiler = GuideCompiler(tokenizer, vocab_size, stop_token_ids, limits)
        self.vocab_size = vocab_size
        self._fill_thread: ThreadPoolExecutor | None = None
        self._batch_matcher: Any = None

    def check(self, guide: Guide, owner: Owner = None) -> None:
        self.compiler.compile(guide, owner)

    async def compile_async(self, guide: Guide, owner: Owner = None) -> Any:
        """The guide's grammar, compiled for `owner` in a worker while the caller's event loop
        goes on. No timeout here: the worker is stopped at the compile deadline, and the time
        a compile waits for its turn must never count as its own."""
        # Shielded: the compile is shared by every request of the owner sending this schema.
        return await asyncio.shield(asyncio.wrap_future(self.compiler.submit(guide, owner)))

    def new_state(self, guide: Guide, grammar: Any = None) -> GuideState:
        """A matcher at the grammar's start; `grammar` is the guide's, compiled beforehand off
        the engine thread (AsyncEngine.submit), else it is compiled (or found cached) now."""
        return GuideState(grammar if grammar is not None else self.compiler.compile(guide))

    def start_fills(self, seqs: list[SequenceState]) -> PendingMasks | None:
        """Start filling the bitmasks of the guided rows among one step's sampling sequences
        (their matchers must not move until `join`); None when no row has a guide."""
        rows = [row for row, seq in enumerate(seqs) if seq.guide_state is not None]
        if not rows:
            return None
        import xgrammar

        if self._fill_thread is None:
            # One Python thread hands the whole batch to xgrammar, which releases the GIL and
            # spreads the rows over its own threads: the forward keeps the interpreter.
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="radixkv-guide")
            self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=min(MAX_FILL_THREADS, os.cpu_count() or 1))
        bitmask = xgrammar.allocate_token_bitmask(len(seqs), self.vocab_size)
        matchers = [seqs[row].guide_state.matcher for row in rows]
        no_control_bytes = self.compiler.no_control_bytes
        assert no_control_bytes is not None  # internal: built with the compiler, before any guide had a state

        def fill() -> None:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            bitmask.bitwise_and_(no_control_bytes)

        return PendingMasks(GuideMasks(rows, bitmask), self._fill_thread.submit(fill))
