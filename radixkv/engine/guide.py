"""JSON-constrained decoding: compiles a `JsonGuide` with xgrammar (one compiler per tokenizer,
grammars cached by schema), keeps one matcher per guided sequence, and fills their next-token
bitmasks on worker threads while the model forward runs.

Why xgrammar rather than llguidance, measured by `radixkv bench guided_decoding` (AMD EPYC
Zen 4, 2 shared cores, SmolLM2's 49,152 tokens): a step's mask costs far less, and that is
paid on every token. Filling 32 rows took 0.6-0.8 ms against llguidance's 15-27 ms, one row
47 us (idle machine) against 364 us; xgrammar's compile (31-38 ms a schema, cached) is slower
than llguidance's lazy 1.3 ms, but it is paid once per schema, not per token.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

# xgrammar is imported where it is first needed: importing it takes about as long as importing
# torch, and an engine that never sees a guide should not pay for it.
from radixkv.cpu.logits import apply_token_bitmask
from radixkv.engine.request import JsonGuide, SequenceState
from radixkv.errors import InvalidRequest

MAX_CACHED_GRAMMARS = 256
# Threads xgrammar fills a step's rows with: enough to spread a large batch, few enough to
# leave the forward its cores.
MAX_FILL_THREADS = 4
# "Any JSON object": strict would forbid every property of a schema that names none.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


class GuideCompiler:
    """Compiles guides for one tokenizer; the vocabulary is the model's logits width (it may
    exceed the tokenizer's), and the engine's EOS ids are the tokens that end a grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None  # built on first use: an unguided engine never pays for it
        self.no_control_bytes: torch.Tensor | None = None  # with the compiler; see _control_free_bitmask
        self._grammars: OrderedDict[tuple[str | None, bool], Any] = OrderedDict()

    def compile(self, guide: JsonGuide) -> Any:
        """The compiled grammar of a guide; InvalidRequest(param="response_format") if its
        schema is not valid JSON Schema text that xgrammar accepts."""
        key = (guide.schema, guide.strict if guide.schema is not None else False)
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        schema = _checked_schema_text(guide.schema)
        try:
            grammar = self._xgrammar_compiler().compile_json_schema(schema, any_whitespace=False, separators=(",", ":"), strict_mode=key[1])
        except (RuntimeError, ValueError, TypeError) as error:
            raise InvalidRequest(f"the JSON schema cannot be compiled: {_first_line(error)}", param="response_format") from error
        self._grammars[key] = grammar
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=min(MAX_FILL_THREADS, os.cpu_count() or 1))
            self.no_control_bytes = _control_free_bitmask(info, self.vocab_size)
        return self._compiler


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


def _checked_schema_text(schema: str | None) -> str:
    """The schema text to compile, refused early when it is not JSON or not a schema object
    (xgrammar's own messages for those are less clear)."""
    if schema is None:
        return ANY_OBJECT_SCHEMA
    if not isinstance(schema, str):
        raise InvalidRequest(f"the JSON schema must be JSON text, got {type(schema).__name__}", param="response_format")
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"the JSON schema is not valid JSON: {error}", param="response_format") from error
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"a JSON schema must be a JSON object, got {type(parsed).__name__}", param="response_format")
    return schema


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


class GuideState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, grammar: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(grammar)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; True once the grammar is complete."""
        accepted = self.matcher.accept_token(token)
        # The sampler drew from the masked row, so only an engine bug can get here.
        assert accepted, f"token {token} was sampled outside the grammar"
        return self.matcher.is_terminated()


@dataclass(slots=True)
class GuideMasks:
    """The bitmasks of one step's guided sampling rows, to apply to the logits before sampling."""

    rows: list[int]  # the sampling rows that have a guide
    bitmask: torch.Tensor  # int32 [sampling rows, ceil(vocab / 32)]; only `rows` are filled

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

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.compiler = GuideCompiler(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._fill_thread: ThreadPoolExecutor | None = None
        self._batch_matcher: Any = None

    def check(self, guide: JsonGuide) -> None:
        self.compiler.compile(guide)

    def new_state(self, guide: JsonGuide) -> GuideState:
        return GuideState(self.compiler.compile(guide))

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
        assert no_control_bytes is not None  # built with the compiler, before any guide had a state

        def fill() -> None:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            bitmask.bitwise_and_(no_control_bytes)

        return PendingMasks(GuideMasks(rows, bitmask), self._fill_thread.submit(fill))
