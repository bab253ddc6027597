"""The engine: holds the cache, scheduler, runner and sampler together and runs the step loop.

`add_request` validates and queues, `step` runs one scheduled batch and returns what is new
for each request that changed, `abort` ends a request at any stage; every ended sequence gives
back every page it held.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from radixkv.attention import make_backend
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.pages import PagePool
from radixkv.cache.radix import RadixTree
from radixkv.config import EngineConfig
from radixkv.engine.compute_cost import ComputeCost, attended
from radixkv.engine.guide import GuideLimits, GuideRejected, Guides
from radixkv.engine.disk_loader import open_disk_tier
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.pins import Owner, PinnedPrefix, Pins
from radixkv.engine.request import (
    Batch,
    CompletionDelta,
    CompletionOutput,
    RequestDelta,
    RequestOutput,
    SamplingParams,
    SeqStatus,
    SequenceState,
    TokenLogprob,
)
from radixkv.engine.runner import ModelRunner
from radixkv.engine.sampler import Sampler
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.stats import EngineCounters, EngineStats, StepTimes
from radixkv.errors import ConfigError, InvalidRequest, QueueFull
from radixkv.kv_events import start_kv_events
from radixkv.model.device import resolve_device, resolve_dtype
from radixkv.model.loader import LoadedModel, load_model

if TYPE_CHECKING:
    from radixkv.kv_events.recorder import KVEventRecorder


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        backend = loaded.model.attention if loaded is not None else make_backend(
            config.attention_backend,
            self.device.type,
            native_kernels=config.native_kernels,
            decode_amx=config.decode_amx,
            share_decode_reads=config.share_decode_reads,
            check_indices=config.check_indices,
        )
        # Before the model loads: a configuration the backend cannot run fails in a blink.
        if config.batch_invariant and not backend.capabilities.batch_invariant:
            raise ConfigError(
                f"batch_invariant needs an attention backend that attends row by row ('torch' or 'cpu'), not {backend.name!r}",
                param="batch_invariant",
            )
        if loaded is None:
            loaded = load_model(
                config.model,
                backend,
                dtype=config.dtype,
                device=config.device,
                cache_dir=config.cache_dir,
                native_kernels=config.native_kernels,
                linear_kernel=config.linear_kernel,
            )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model_config = loaded.config
        self.model_config = model_config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
        self.eos_token_ids = set(model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        num_pages = config.num_pages or self._pages_from_memory()
        self.pool = PagePool(
            num_pages,
            config.page_size,
            model_config.num_layers,
            model_config.num_kv_heads,
            model_config.head_dim,
            loaded.dtype,
            loaded.device,
        )
        # The most tokens (prompt + completion) one request may have: the model's context, or
        # less when the page pool is smaller. Every layer that checks a length reads this.
        self.max_context_tokens = min(self.max_model_len, num_pages * config.page_size)
        self.hasher = BlockHasher(config.page_size, seed=config.hash_seed)
        self.tree = RadixTree(
            self.pool, self.hasher, eviction_policy=config.eviction_policy,
            max_retained_pages=int(num_pages * config.max_retained_pages_fraction),
        )
        self.compute_cost = ComputeCost()
        self.kv = KVManager(
            self.pool,
            self.tree,
            self.hasher,
            config.enable_prefix_caching,
            open_disk_tier(config, loaded, self.pool.page_nbytes),
            self.compute_cost.estimate_s,
            config.kv_disk_prefetch_bytes,
            config.max_retained_pages_per_owner,
        )
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(loaded.model, self.pool, loaded.device, batch_invariant=config.batch_invariant)
        self.sampler = Sampler(config.seed)
        guide_limits = GuideLimits(
            config.max_guide_schema_bytes, config.max_guide_schema_depth, config.guide_compile_timeout_s, config.guide_mask_timeout_s
        )
        self.guides = Guides(self.tokenizer, model_config.vocab_size, sorted(self.eos_token_ids), guide_limits)
        self._num_guided = 0  # live guided sequences: a step without any skips the guide work
        self._requests: dict[str, list[SequenceState]] = {}
        # Requests a step failed alone (a broken logits row, a sampler error on their row):
        # aborted, pages back; the AsyncEngine takes them to fail their streams.
        self.failed_requests: list[tuple[str, BaseException]] = []
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        # Pins and their caps live here, not in the server, so in-process callers get the same.
        self.pins = Pins(
            self.kv, num_pages, config.page_size, self.max_context_tokens, config.max_pinned_pages, config.max_pinned_pages_per_owner
        )
        self.counters = EngineCounters()
        self.step_times = StepTimes()
        # KV events (off by default): the tree tells the recorder of every block it stores or
        # evicts; each step's events go out as one batch. Opened last, so a failed start
        # leaves no socket bound.
        self.kv_events: KVEventRecorder | None = None
        if config.kv_events_endpoint is not None:
            self.kv_events = start_kv_events(config, "GPU" if self.device.type == "cuda" else "CPU")
            self.tree.listener = self.kv_events

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        salt: str | None = None,
        request_id: str | None = None,
        guide_grammar: Any = None,
        owner: Owner = None,
    ) -> str:
        """Queue a request; its id. `guide_grammar` is params.guide compiled beforehand off
        this thread (AsyncEngine.submit); without it a guide compiles (or is found cached) here.
        `owner` (the server's Tenants.owner) is whose fair share of the batch it takes.
        max_tokens None becomes the room the context leaves after this prompt (for this
        request only: `params` may be shared)."""
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params, salt, guide_checked=guide_grammar is not None)
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_context_tokens - len(prompt_token_ids))
        if params.n > self.queue_room():
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later", limit=self.config.max_queue_len)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use", param="request_id")
        prompt = list(prompt_token_ids)
        seqs = [
            SequenceState(next(self._seq_ids), request_id, i, prompt, params, salt, self.scheduler.step_count, owner=owner)
            for i in range(params.n)
        ]
        if params.guide is not None:
            for seq in seqs:
                seq.guide_state = self.guides.new_state(params.guide, guide_grammar)
            self._num_guided += len(seqs)
        self._requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def queue_room(self) -> int:
        """How many more sequences the waiting queue takes before add_request raises QueueFull."""
        return self.config.max_queue_len - len(self.scheduler.waiting)

    def check_request(self, prompt: list[int], params: SamplingParams, salt: str | None = None, *, guide_checked: bool = False) -> None:
        """Raise InvalidRequest (naming the parameter and the limit) unless the engine can run
        this request: a valid prompt that fits the context (with max_tokens, or leaving room
        for one token when it is None) and the page pool beside the pins. The one context
        check: no other layer repeats it."""
        self._check_prompt(prompt)
        total = len(prompt) + (params.max_tokens if params.max_tokens is not None else 1)
        if total > self.max_context_tokens:
            raise InvalidRequest(
                f"{self._context_limit_text()}; the request needs {total} ({len(prompt)} prompt + {params.max_tokens} max_tokens)",
                param="max_tokens",
                code="context_length_exceeded",
                limit=self.max_context_tokens,
            )
        if self.pins:
            # max_tokens None fills the context: the most pages it may take.
            total = len(prompt) + params.max_tokens if params.max_tokens is not None else self.max_context_tokens
            self.pins.check_room(prompt, -(-total // self.pool.page_size), salt)
        if params.guide is not None and not guide_checked:
            self.guides.check(params.guide)  # compiles it once; add_request finds it cached

    def _check_prompt(self, prompt: list[int]) -> None:
        """InvalidRequest (param "prompt") unless `prompt` is token ids of this model that leave
        the context room for at least one more token."""
        if not prompt:
            raise InvalidRequest("the prompt is empty; it needs at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", param="prompt", limit=vocab)
        if len(prompt) >= self.max_context_tokens:
            raise InvalidRequest(
                f"{self._context_limit_text()}; the prompt has {len(prompt)} tokens, which leaves no room for a completion",
                param="prompt",
                code="context_length_exceeded",
                limit=self.max_context_tokens,
            )

    def _context_limit_text(self) -> str:
        text = f"this model's maximum context length is {self.max_context_tokens} tokens"
        if self.max_context_tokens < self.max_model_len:
            text += f" (the KV page pool holds {self.pool.num_pages} pages of {self.pool.page_size} tokens)"
        return text

    def abort(self, request_id: str) -> RequestDelta | None:
        """End a request wherever it is; its pages go back. None if it is unknown or done."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return None
        live = [seq for seq in seqs if not seq.finished]
        for seq in live:
            self._finish(seq, "abort")
        return self._delta(seqs, live)

    def abort_all(self) -> int:
        """End every request, wherever it is; all their pages go back. Returns how many ended."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    def pin(
        self, prefix_token_ids: list[int], salt: str | None = None, *, owner: Owner = None, ttl_s: float | None = None
    ) -> PinnedPrefix:
        """Lock the cached full blocks of a prefix so eviction never takes them (until unpin,
        or `ttl_s` seconds). Only what is cached now is pinned: compute the prefix first (a
        request for it) to pin all of it. Pinned pages count as in use, not evictable. The pin
        id is random. Capped per `owner` (the server's Tenants.owner; in-process callers are
        one owner, None) and over all owners (EngineConfig.max_pinned_pages*): InvalidRequest
        past a cap (OwnerCapExceeded past the owner's own), for a prefix too long for the
        context, or one that locks no full page; nothing is locked then."""
        self._check_prompt(list(prefix_token_ids))
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 <= ttl_s < float("inf")):
            raise InvalidRequest(f"a pin ttl must be a non-negative number of seconds, got {ttl_s!r}", param="ttl")
        return self.pins.pin(list(prefix_token_ids), salt, owner, ttl_s)

    def unpin(self, pin_id: int, owner: Owner = None) -> bool:
        """Release `owner`'s pin; False if it is unknown, expired or another owner's (the same
        answer, so an id tells nothing)."""
        return self.pins.unpin(pin_id, owner)

    def pins_of(self, owner: Owner = None) -> list[PinnedPrefix]:
        """`owner`'s live pins, oldest first (expired ones are released first)."""
        return self.pins.owned_by(owner)

    def expire_pins(self) -> int:
        """Release every pin past its ttl now; how many were. Pins also expire at any pin call."""
        return self.pins.expire()

    def retain(self, prefix_token_ids: list[int], salt: str | None = None, ttl_s: float = 300.0, owner: Owner = None) -> int:
        """Keep the cached full blocks of a prefix cached for ttl_s seconds: eviction takes them
        only after every unretained evictable page, earliest expiry first. Never locks, so no
        request waits for them. Only what is cached now is retained, at most
        config.max_retained_pages_per_owner pages per owner and max_retained_pages_fraction of
        the pool over all owners (past that, trimmed); returns the tokens retained."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < float("inf"):
            raise InvalidRequest(f"a retention ttl must be a positive number of seconds, got {ttl_s!r}", param="ttl")
        cap = self.config.max_retained_pages_per_owner
        return self.kv.retain(prefix_token_ids, salt, float(ttl_s), owner, cap)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """The requests steps failed alone since the last call (already aborted), with why."""
        failed, self.failed_requests = self.failed_requests, []
        return failed

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one batch; return what is new for every request that changed (the last delta of
        a request that ended carries its whole output)."""
        try:
            return self._step()
        finally:
            if self.kv_events is not None:
                self.kv_events.flush()  # even after a failed step: what the tree did stands

    def _step(self) -> list[RequestDelta]:
        clock = _PhaseClock(self.step_times)
        batch = self.scheduler.schedule()
        if not batch:
            if batch.num_loaded_tokens:
                self.counters.num_steps += 1  # a step that only loaded from disk still moved on
                if self.config.check_invariants:
                    self.check_invariants()
            return []
        sampling = [item.seq for item in batch.items if item.samples]
        # The grammar masks fill on worker threads while the forward runs.
        pending = self.guides.start_fills(sampling) if self._num_guided else None
        clock.lap("schedule")
        try:
            prepared = self.runner.prepare(batch)
            clock.lap("prepare")
            forward_start_s = clock.last
            logits = self.runner.forward(*prepared)
            clock.lap("forward")
            self.compute_cost.observe(
                batch.num_tokens,
                sum(attended(item.seq.num_computed_tokens, item.num_new_tokens) for item in batch.items),
                clock.last - forward_start_s,
            )
        finally:
            masks = pending.join() if pending is not None else None
        broken: dict[int, BaseException] = {}
        if masks is not None:
            for row in masks.take_dead_rows():
                broken[row] = InvalidRequest(
                    f"the JSON schema allows no token this model can produce after {len(sampling[row].output_token_ids)} "
                    "generated tokens (e.g. a pattern only raw control characters would continue)",
                    param="response_format",
                    code="schema_unsatisfiable",
                )
        # Rows with NaN or infinite logits (one bad sequence, e.g. an overflow; a row sum is
        # finite exactly when its entries are, one cheap pass) are zeroed so the batch still
        # samples, and their requests then fail alone. On a device the fill runs unconditionally
        # and the rows are read back after sampling, whose transfer has synced already: no stall.
        with torch.inference_mode():  # the logits are an inference tensor: update it in place there
            non_finite = ~torch.isfinite(logits.sum(dim=-1))
            if logits.device.type != "cpu" or bool(non_finite.any()):
                logits.masked_fill_(non_finite.unsqueeze(-1), 0.0)
        tokens, logprobs = self._sample(logits, sampling, masks, broken)
        for row in non_finite.nonzero().flatten().tolist():
            broken.setdefault(row, FloatingPointError("non-finite logits"))
        clock.lap("sample")
        self._account(batch, prepared[1].backend_state)
        for item in batch.items:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(item.seq)
        now = time.perf_counter()
        changed: dict[str, list[SequenceState]] = {}
        for row, (seq, token) in enumerate(zip(sampling, tokens)):
            if row in broken:
                continue
            try:
                self._append_token(seq, token, logprobs[row] if logprobs else None, now)
            except GuideRejected as error:
                broken[row] = error
                continue
            changed.setdefault(seq.request_id, []).append(seq)
        failed = {sampling[row].request_id: error for row, error in broken.items()}
        for request_id, error in failed.items():
            changed.pop(request_id, None)
            self.abort(request_id)
            self.failed_requests.append((request_id, error))
        deltas = [self._delta(self._requests[request_id], seqs) for request_id, seqs in changed.items()]
        for delta in deltas:
            if delta.finished:
                del self._requests[delta.request_id]
        clock.lap("postprocess")
        if self.config.check_invariants:
            self.check_invariants()
        return deltas

    def _sample(
        self, logits: torch.Tensor, sampling: list[SequenceState], masks: Any, broken: dict[int, BaseException]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The batch sampled at once; if that fails, row by row, so only the rows that fail
        (added to `broken`) lose their request. Row by row, a guided row's mask is applied to
        the logits first, so its logprobs are of the masked logits (this fallback only)."""
        try:
            return self.sampler.sample(logits, sampling) if masks is None else self.sampler.sample(logits, sampling, masks)
        except Exception:  # noqa: BLE001 - find the row at fault below
            if masks is not None:
                with torch.inference_mode():
                    masks.apply(logits)  # may have been applied already: masking twice is a no-op
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        for row, seq in enumerate(sampling):
            try:
                row_tokens, row_logprobs = self.sampler.sample(logits[row : row + 1].clone(), [seq])
            except Exception as error:  # noqa: BLE001 - this row's request fails, alone
                broken[row] = error
                row_tokens, row_logprobs = [0], []
            tokens.append(row_tokens[0])
            logprobs.append(row_logprobs[0] if row_logprobs else None)
        return tokens, logprobs if any(lp is not None for lp in logprobs) else []

    def _account(self, batch: Batch, backend_state: object) -> None:
        counters = self.counters
        counters.num_steps += 1
        # Backends that count their decode reads (CPU and Triton) leave them on their state.
        reads = getattr(backend_state, "kv_reads", None)
        if reads is not None:
            counters.num_kv_tokens_read += reads.tokens
            counters.num_kv_tokens_read_shared += reads.shared_tokens
        for item in batch.items:
            start = item.seq.num_computed_tokens
            counters.num_tokens_computed += item.num_new_tokens
            prompt_end = len(item.seq.prompt_token_ids)
            counters.num_prompt_tokens_computed += max(0, min(start + item.num_new_tokens, prompt_end) - start)

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
            self._num_guided -= 1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

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
            output=self._output(seqs) if finished else None,
        )

    def _output(self, seqs: list[SequenceState]) -> RequestOutput:
        first = seqs[0]
        first_token_times = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
        return RequestOutput(
            request_id=first.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[
                CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason, list(s.output_logprobs)) for s in seqs
            ],
            num_prompt_tokens=len(first.prompt_token_ids),
            num_cached_tokens=max(s.num_cached_tokens for s in seqs),
            time_to_first_token_s=min(first_token_times) - first.arrival_time if first_token_times else None,
            total_time_s=max(finish_times) - first.arrival_time if finish_times else None,
        )

    def lookup(self, prompt_token_ids: list[int], salt: str | None = None) -> tuple[int, int]:
        """(prompt tokens cached in RAM, tokens after those cached on disk), in full blocks;
        a pure lookup (POST /v1/cache/lookup)."""
        return self.kv.lookup(prompt_token_ids, salt)

    def flush_cache(self, *, ram: bool = True, disk: bool = True) -> tuple[int, int]:
        """Drop the prefix cache's unlocked RAM pages and/or its disk blocks; (pages freed,
        blocks deleted). Running requests and pins keep theirs."""
        flushed = self.kv.flush(ram, disk)
        if self.kv_events is not None:
            self.kv_events.flush()
        return flushed

    def stop_kv_events(self) -> None:
        """Publish the last KV events and close their sockets (at shutdown); a no-op when off."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.tree.listener = None
            self.kv_events = None

    def close(self) -> int:
        """Write what RAM caches to the disk tier, so the next start finds it warm, and release
        its directory; returns the blocks written (0 without a disk tier). The engine stays
        usable, without the disk tier."""
        return self.kv.close()

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool, tree = self.pool, self.tree
        tree.expire()  # so retained_pages counts live retentions only
        return EngineStats(
            counters=replace(self.counters),
            cache=tree.stats(),
            num_pages=pool.num_pages,
            num_free_pages=pool.num_free,
            num_pages_in_use=pool.num_pages - pool.num_free - tree.evictable_pages,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_unfinished=len(self._requests),
            num_preemptions=self.scheduler.num_preemptions,
            num_deferrals=self.scheduler.num_deferrals,
            disk=self.kv.disk_stats(),
            residency=self.kv.residency(),
        )

    def check_invariants(self) -> None:
        """free + evictable + in use == total, no page counted twice, refcounts explained."""
        self.tree.check_invariants()
        free = self.pool.free_pages()
        evictable = self.tree.evictable_page_set()
        cached = self.tree.cached_page_set()
        assert not free & evictable, f"pages both free and evictable: {sorted(free & evictable)[:8]}"
        expected = [0] * self.pool.num_pages
        for page in cached:
            expected[page] += 1
        for seq in self.scheduler.running:
            for page in seq.page_table:
                expected[page] += 1
        for seq in self.scheduler.waiting:
            assert not seq.page_table and seq.tree_node is None, f"waiting seq {seq.seq_id} holds pages"
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == expected[page], (
                f"page {page}: refcount {self.pool.refcount(page)}, expected {expected[page]}"
            )
        in_use = {p for p in range(self.pool.num_pages) if expected[p] and p not in evictable}
        assert len(free) + len(evictable) + len(in_use) == self.pool.num_pages

    def _pages_from_memory(self) -> int:
        mc = self.model_config
        page_bytes = PagePool.bytes_per_page(self.config.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(self.device)[0]
        else:
            free_bytes = _available_memory_bytes()
        pages = int(free_bytes * self.config.kv_memory_fraction) // page_bytes
        return max(1, min(pages, self.config.max_kv_pages))


class _PhaseClock:
    """Adds the time since the previous lap to a named phase: where each step's time goes."""

    def __init__(self, totals: StepTimes) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.totals, phase, getattr(self.totals, phase) + now - self.last)
        self.last = now


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # no /proc: assume a modest 4 GiB
