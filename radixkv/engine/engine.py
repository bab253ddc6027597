"""The engine: holds the cache, scheduler, runner and sampler together and runs the step loop.

`add_request` validates and queues, `step` runs one scheduled batch and returns the requests
whose state changed, `abort` ends a request at any stage; every ended sequence gives back
every page it held.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from radixkv.attention import make_backend
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.pages import PagePool
from radixkv.cache.radix import RadixTree
from radixkv.config import EngineConfig
from radixkv.engine.kv_manager import KVManager
from radixkv.errors import ConfigError, InvalidRequest, QueueFull
from radixkv.engine.request import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    Sequence,
    SeqStatus,
)
from radixkv.engine.runner import ModelRunner
from radixkv.engine.sampler import Sampler
from radixkv.engine.scheduler import Batch, Scheduler
from radixkv.model.device import resolve_device, resolve_dtype
from radixkv.model.loader import LoadedModel, load_model


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    pin_id: int
    num_pinned_tokens: int
    node: Any


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if loaded is None:
            backend = make_backend(
                config.attention_backend,
                self.device.type,
                native_kernels=config.native_kernels,
                decode_amx=config.decode_amx,
                check_indices=config.check_indices,
            )
            loaded = load_model(
                config.model,
                backend,
                dtype=config.dtype,
                device=config.device,
                cache_dir=config.cache_dir,
                native_kernels=config.native_kernels,
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
        self.hasher = BlockHasher(config.page_size, seed=config.seed)
        self.tree = RadixTree(self.pool, self.hasher)
        self.kv = KVManager(self.pool, self.tree, self.hasher, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        backend = loaded.model.attention
        if config.batch_invariant and not backend.capabilities.batch_invariant:
            raise ConfigError(f"batch_invariant needs a backend that attends row by row, not {backend.name!r}", param="batch_invariant")
        self.runner = ModelRunner(loaded.model, self.pool, loaded.device, batch_invariant=config.batch_invariant)
        self.sampler = Sampler(config.seed)
        self._requests: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._pin_ids = itertools.count(1)
        self._pins: dict[int, PinnedPrefix] = {}
        self.counters = {"steps": 0, "tokens_computed": 0, "prefill_tokens_computed": 0, "output_tokens": 0}
        self.timings_s = dict.fromkeys(("schedule", "prepare", "forward", "sample", "postprocess"), 0.0)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        salt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        self._validate(prompt_token_ids, params, salt)
        if params.n > self.queue_room():
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later", limit=self.config.max_queue_len)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use", param="request_id")
        prompt = list(prompt_token_ids)
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, prompt, params, salt, self.scheduler.step_count)
            for i in range(params.n)
        ]
        self._requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def queue_room(self) -> int:
        """How many more sequences the waiting queue takes before add_request raises QueueFull."""
        return self.config.max_queue_len - len(self.scheduler.waiting)

    def _validate(self, prompt: list[int], params: SamplingParams, salt: str | None = None) -> None:
        if not prompt:
            raise InvalidRequest("the prompt is empty; it needs at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", param="prompt", limit=vocab)
        if len(prompt) >= self.max_context_tokens:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_context_tokens} tokens; the prompt has "
                f"{len(prompt)} tokens, which leaves no room for a completion",
                param="prompt",
                code="context_length_exceeded",
                limit=self.max_context_tokens,
            )
        total = len(prompt) + params.max_tokens
        if total > self.max_context_tokens:
            raise InvalidRequest(
                f"this model's maximum context length is {self.max_context_tokens} tokens; the request needs "
                f"{total} ({len(prompt)} prompt + {params.max_tokens} completion)",
                param="max_tokens",
                code="context_length_exceeded",
                limit=self.max_context_tokens,
            )
        pages = -(-total // self.pool.page_size)
        if self._pins:
            self._check_room_beside_pins(prompt, pages, salt)

    def _check_room_beside_pins(self, prompt: list[int], pages: int, salt: str | None) -> None:
        # Pinned pages are never evicted, so a request that cannot fit beside them would wait
        # forever. The pinned blocks it starts with are its own and do not count against it.
        pinned: set[int] = set()
        for pin in self._pins.values():
            node = pin.node
            while node is not None:
                pinned.update(node.pages)
                node = node.parent
        shared = 0
        if self.kv.enable_prefix_caching:
            match = self.tree.match(prompt, salt, record=False)
            shared = sum(1 for page in match.pages if page in pinned)
        room = self.pool.num_pages - len(pinned)
        if pages - shared > room:
            raise InvalidRequest(
                f"the request needs up to {pages - shared} KV pages besides pinned ones, but pins hold {len(pinned)} "
                f"of the pool's {self.pool.num_pages}, leaving {room}; unpin a prefix or send a shorter request",
                param="prompt",
                limit=room,
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is; its pages go back. None if it is unknown or done."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.finished:
                self._finish(seq, "abort")
        return self._output(seqs)

    def pin(self, prefix_token_ids: list[int], salt: str | None = None) -> PinnedPrefix:
        """Lock the cached full blocks of a prefix so eviction never takes them (until unpin).

        Only what is cached now is pinned: compute the prefix first (a request for it) to pin
        all of it. Pinned pages count as in use, not evictable.
        """
        # match() leaves the last token to compute; one more token lets it return every full
        # block of the prefix itself (a partial block never matches).
        match = self.tree.match(list(prefix_token_ids) + [0], salt, record=False)
        self.tree.lock(match.node)
        pinned = PinnedPrefix(next(self._pin_ids), match.num_cached_tokens, match.node)
        self._pins[pinned.pin_id] = pinned
        return pinned

    def unpin(self, pin_id: int) -> bool:
        """Release a pin; False if it was unknown (already released)."""
        pinned = self._pins.pop(pin_id, None)
        if pinned is None:
            return False
        self.tree.unlock(pinned.node)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of every request that changed (finished ones last time)."""
        clock = _PhaseClock(self.timings_s)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        clock.lap("schedule")
        prepared = self.runner.prepare(batch)
        clock.lap("prepare")
        logits = self.runner.forward(*prepared)
        clock.lap("forward")
        sampling = [item.seq for item in batch.items if item.samples]
        tokens = self.sampler.sample(logits, sampling)
        clock.lap("sample")
        self._account(batch)
        for item in batch.items:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(item.seq)
        now = time.perf_counter()
        for seq, token in zip(sampling, tokens):
            self._append_token(seq, token, now)
        changed = {seq.request_id: None for seq in sampling}
        outputs = [self._output(self._requests[rid]) for rid in changed]
        for output in outputs:
            if output.finished:
                del self._requests[output.request_id]
        clock.lap("postprocess")
        if self.config.check_invariants:
            self.check_invariants()
        return outputs

    def _account(self, batch: Batch) -> None:
        self.counters["steps"] += 1
        for item in batch.items:
            start = item.seq.num_computed_tokens
            self.counters["tokens_computed"] += item.num_new_tokens
            prompt_end = len(item.seq.prompt_token_ids)
            self.counters["prefill_tokens_computed"] += max(0, min(start + item.num_new_tokens, prompt_end) - start)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        self.counters["output_tokens"] += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        self._detokenize(seq)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if params.stop and self._truncate_at_stop(seq):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _truncate_at_stop(self, seq: Sequence) -> bool:
        positions = [p for p in (seq.text.find(s) for s in seq.params.stop) if p >= 0]
        if not positions:
            return False
        seq.text = seq.text[: min(positions)]
        return True

    def _detokenize(self, seq: Sequence) -> None:
        # Decode a short window and emit only complete characters: a byte-level token may end
        # mid-character, which decodes to U+FFFD until the next token completes it.
        ids = seq.output_token_ids
        before = self.tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[seq.detok_prefix_offset :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.text += after[len(before) :]
            seq.detok_prefix_offset = seq.detok_read_offset
            seq.detok_read_offset = len(ids)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

    def _output(self, seqs: list[Sequence]) -> RequestOutput:
        first = seqs[0]
        finished = all(s.finished for s in seqs)
        first_token_times = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
        return RequestOutput(
            request_id=first.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason) for s in seqs],
            finished=finished,
            num_prompt_tokens=len(first.prompt_token_ids),
            num_cached_tokens=max(s.num_cached_tokens for s in seqs),
            time_to_first_token_s=min(first_token_times) - first.arrival_time if first_token_times else None,
            total_time_s=max(finish_times) - first.arrival_time if finished and finish_times else None,
        )

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        cache = asdict(self.tree.stats())
        return {
            **self.counters,
            "cache": cache,
            "cache_hit_rate": cache["hit_rate"],
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_cached": self.tree.cached_pages,
            "pages_evictable": self.tree.evictable_pages,
            "pages_in_use": self.pool.num_pages - self.pool.num_free - self.tree.evictable_pages,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_deferrals": self.scheduler.num_deferrals,
        }

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

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.last
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
