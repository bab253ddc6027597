"""The request book: every request the engine holds, by id, and what a step's tokens do to them.

`postprocess` commits a step (computed tokens, KV blocks), applies the keeps of each request
whose prompt it computed, appends each sampled token, decides finish reasons and turns the
changes into deltas, applying a finished request's keeps into the reply; a request leaves the book exactly when its
last delta (with its whole output) is made, it is aborted, or a step fails it alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from radixkv.engine.guide import GuideRejected
from radixkv.engine.keeps import Keeper
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import Batch, SeqStatus, SequenceState
from radixkv.engine.request_output import CompletionDelta, CompletionOutput, RequestDelta, RequestOutput, TokenLogprob
from radixkv.engine.runner import StepResult
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.stats import EngineCounters

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestBook:
    """The requests the engine holds (a request of n > 1 continuations is one entry of n
    sequences). Reads like a mapping from request id to its sequences."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVManager,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: set[int],
        max_model_len: int,
        counters: EngineCounters,
        keeper: Keeper,
    ) -> None:
        self.scheduler = scheduler
        self.keeper = keeper
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.counters = counters
        self._requests: dict[str, list[SequenceState]] = {}
        self.num_guided = 0  # live guided sequences: a step without any skips the guide work
        # Requests a step failed alone (a broken logits row, a sampler error on their row):
        # aborted, pages back; the AsyncEngine takes them to fail their streams.
        self._failed: list[tuple[str, BaseException]] = []

    # -- the mapping ---------------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __getitem__(self, request_id: str) -> list[SequenceState]:
        return self._requests[request_id]

    def get(self, request_id: str) -> list[SequenceState] | None:
        return self._requests.get(request_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def register(self, request_id: str, seqs: list[SequenceState]) -> None:
        """Book a new request's sequences (already queued or about to be)."""
        assert request_id not in self._requests, f"request {request_id!r} is booked already"
        self._requests[request_id] = seqs
        self.num_guided += sum(1 for seq in seqs if seq.guide_state is not None)

    # -- ending requests -----------------------------------------------------------------------

    def abort(self, request_id: str) -> RequestDelta | None:
        """End a request wherever it is; its pages go back. None if it is unknown or done."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return None
        live = [seq for seq in seqs if not seq.finished]
        for seq in live:
            self._finish(seq, "abort")
        return self._delta(seqs, live)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """The requests steps failed alone since the last call (already aborted), with why."""
        failed, self._failed = self._failed, []
        return failed

    # -- a step's results ----------------------------------------------------------------------

    def postprocess(self, batch: Batch, result: StepResult) -> list[RequestDelta]:
        """Commit the batch's computed tokens, append each sampled token, finish what ended, fail
        the rows the step broke (their requests alone), and return a delta per changed request."""
        self.counters.record_step(batch, result.kv_reads)
        for item in batch.items:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(item.seq)
            if self.keeper.due(item.seq):
                self._keep(self._requests[item.seq.request_id])
        broken = dict(result.failed)
        now = time.perf_counter()
        changed: dict[str, list[SequenceState]] = {}
        for row, (seq, token) in enumerate(zip(result.seqs, result.tokens)):
            if row in broken:
                continue
            try:
                self._append_token(seq, token, result.logprobs[row] if result.logprobs else None, now)
            except GuideRejected as error:
                broken[row] = error
                continue
            changed.setdefault(seq.request_id, []).append(seq)
        failed = {result.seqs[row].request_id: error for row, error in broken.items()}
        for request_id, error in failed.items():
            changed.pop(request_id, None)
            self.abort(request_id)
            self._failed.append((request_id, error))
        deltas = [self._delta(self._requests[request_id], seqs) for request_id, seqs in changed.items()]
        for delta in deltas:
            if delta.output is not None:
                self.keeper.finish(self._requests.pop(delta.request_id)[0], delta.output)  # a session's turn
        return deltas

    def _keep(self, seqs: list[SequenceState]) -> None:
        """Apply the request's keeps once (its prompt is now in the tree, before any token is
        appended or the request can finish), the report shared by its every sequence."""
        first = next(seq for seq in seqs if self.keeper.due(seq))
        report = self.keeper.apply(first, max(seq.num_cached_tokens for seq in seqs))
        for seq in seqs:
            seq.kept = report

    def _append_token(self, seq: SequenceState, token: int, logprob: TokenLogprob | None, now: float) -> None:
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        self.counters.num_output_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        hit_stop = seq.text_state.append(self.tokenizer, seq.output_token_ids)
        grammar_done = seq.guide_state is not None and seq.guide_state.accept(token)
        reason = self._finish_reason(seq, token, hit_stop or grammar_done)
        if reason is not None:
            self._finish(seq, reason)

    def _finish_reason(self, seq: SequenceState, token: int, stopped: bool) -> str | None:
        params = seq.params
        if stopped or token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: SequenceState, reason: str) -> None:
        self.scheduler.remove(seq)
        if seq.guide_state is not None:
            self.num_guided -= 1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

    # -- deltas and outputs --------------------------------------------------------------------

    def _delta(self, seqs: list[SequenceState], changed: list[SequenceState]) -> RequestDelta:
        """What the changed continuations gained since their last delta; with the whole output
        once every continuation has ended."""
        completions = []
        for seq in changed:
            new_token_ids = seq.output_token_ids[seq.num_sent_tokens :]
            new_logprobs = seq.output_logprobs[seq.num_sent_tokens :]
            seq.num_sent_tokens = len(seq.output_token_ids)
            completions.append(
                CompletionDelta(seq.index, seq.text_state.pending(seq.finished), new_token_ids, seq.finish_reason, new_logprobs)
            )
        first = seqs[0]
        first_token_times = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finished = all(s.finished for s in seqs)
        return RequestDelta(
            request_id=first.request_id,
            completions=completions,
            num_prompt_tokens=len(first.prompt_token_ids),
            num_cached_tokens=max(s.num_cached_tokens for s in seqs),
            time_to_first_token_s=min(first_token_times) - first.arrival_time if first_token_times else None,
            output=_output(seqs) if finished else None,
        )


def _output(seqs: list[SequenceState]) -> RequestOutput:
    first = seqs[0]
    first_token_times = [s.first_token_time for s in seqs if s.first_token_time is not None]
    finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
    return RequestOutput(
        request_id=first.request_id,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[
            CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason, list(s.output_logprobs), stop_string=s.text_state.stop_string)
            for s in seqs
        ],
        num_prompt_tokens=len(first.prompt_token_ids),
        num_cached_tokens=max(s.num_cached_tokens for s in seqs),
        time_to_first_token_s=min(first_token_times) - first.arrival_time if first_token_times else None,
        total_time_s=max(finish_times) - first.arrival_time if finish_times else None,
        cache_report=next((s.cache_report for s in seqs if s.cache_report is not None), None),
        kept=first.kept,
    )
