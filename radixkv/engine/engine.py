"""The engine: holds the cache, scheduler, runner and sampler together and runs the step loop.

`add_request` validates and books a request (engine/outputs.py's RequestBook) and queues it;
`step` is one expiry pass (pins, sessions, retentions) -> schedule (Scheduler) -> run
(ModelRunner: prepare, forward, NaN guard, sample) -> postprocess (RequestBook: commit, keeps,
tokens, finish, deltas) -> the ended requests told to RequestHooks (sessions, predictor);
`abort` ends a request at any stage. Every ended sequence gives back every page it held.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from radixkv.config import EngineConfig
from radixkv.engine.build import build_cache, build_guides, eos_token_ids, load_engine_model, resolve_batch_invariant
from radixkv.engine.context import ContextLimit
from radixkv.engine.detokenizer import ContentStops
from radixkv.engine.invariants import check_page_accounting
from radixkv.engine.keeps import Keeper, check_keeps
from radixkv.engine.outputs import RequestBook
from radixkv.engine.pins import Owner, PinnedPrefix, Pins
from radixkv.engine.request import CacheLookup, Keep, SequenceState
from radixkv.engine.request_output import RequestDelta
from radixkv.engine.runner import ModelRunner
from radixkv.engine.sampler import Sampler
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.request_hooks import RequestHooks
from radixkv.engine.sessions import SessionRef
from radixkv.engine.stats import EngineCounters, EngineStats, StepTimes
from radixkv.errors import InvalidRequest, QueueFull
from radixkv.kv_events import start_kv_events
from radixkv.model.device import resolve_device, resolve_dtype
from radixkv.model.loader import LoadedModel
from radixkv.prompts.harmony import harmony_tokens

if TYPE_CHECKING:
    from radixkv.kv_events.recorder import KVEventRecorder


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_engine_model(config, self.device, loaded)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        model_config = loaded.config
        self.model_config = model_config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(loaded)
        self.harmony = harmony_tokens(self.tokenizer)  # gpt-oss's markers: its chat replies' stops match their content
        cache = build_cache(config, loaded, self.device)
        self.kv_dtype, self.pool, self.hasher, self.tree, self.kv = cache.kv_dtype, cache.pool, cache.hasher, cache.tree, cache.kv
        self.windows = cache.windows  # the window layers' pages (layer groups), None for one group
        # The whole cache as reports see it (lookup, residency, disk, misses) and flush/close act on it.
        self.cache_view = cache.view
        self.compute_cost = cache.compute_cost
        num_pages = self.pool.num_pages
        # The most tokens (prompt + completion) one request may have: the model's context, or
        # less when the page pool is smaller. Every layer that checks a length reads this.
        self.max_context_tokens = min(self.max_model_len, num_pages * config.page_size)
        self.context = ContextLimit(self.max_context_tokens, self.max_model_len, num_pages, config.page_size, model_config.vocab_size)
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler(config.seed, tuple(sorted(self.eos_token_ids)))
        self.batch_invariant = resolve_batch_invariant(config, loaded)
        self.runner = ModelRunner(loaded.model, self.pool, loaded.device, self.sampler, self.batch_invariant, cache.groups, cache.windows)
        self.guides = build_guides(config, loaded, self.eos_token_ids)
        self.counters = EngineCounters()
        self.step_times = StepTimes()
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        # Pins and their caps live here, not in the server, so in-process callers get the same.
        self.pins = Pins(
            self.kv, num_pages, config.page_size, self.max_context_tokens, config.max_pinned_pages, config.max_pinned_pages_per_owner
        )
        # The session book and, under `predict`, the dead-block predictor: told of each request.
        self.hooks = RequestHooks(config, self.kv, self.tree, self.hasher, self.tree.now_s)
        self.sessions, self.predicted = self.hooks.sessions, self.hooks.predicted
        # A request's keeps go through the same retention and pins (and caps) as the verbs below.
        self.keeper = Keeper(self.kv, self.tree, self.pins, config.max_retained_pages_per_owner, self.tree.now_s, self.sessions)
        self.requests = RequestBook(
            self.scheduler, self.kv, self.tokenizer, self.eos_token_ids, self.max_model_len, self.counters, self.keeper
        )
        # KV events (off by default): the cache's bus tells the recorder of every block the tree
        # stores or evicts; each step's events go out as one batch. Opened last, so a failed start
        # leaves no socket bound.
        self.kv_events: KVEventRecorder | None = None
        if config.kv_events_endpoint is not None:
            self.kv_events = start_kv_events(config, "GPU" if self.device.type == "cuda" else "CPU")
            self.tree.events.subscribe(self.kv_events.listen)

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
        session: SessionRef | None = None,
        sibling_salts: tuple[str | None, ...] = (),
        keeps: tuple[Keep, ...] = (),
    ) -> str:
        """Queue a request; its id. `guide_grammar` is params.guide compiled beforehand off
        this thread (AsyncEngine.submit); without it a guide compiles (or is found cached) here.
        `owner` (the server's Tenants.owner) is whose fair share of the batch it takes.
        `sibling_salts`: the owner's other partitions, which its cache report may name as
        holding what it missed (another_partition); never another owner's.
        max_tokens None becomes the room the context leaves after this prompt (for this
        request only: `params` may be shared). `session` names the owner's session this turn
        continues (engine/sessions.py): checked against its caps here, before any work; the
        turn is a keep into the reply, retained when the request finishes.
        `keeps` (engine/keeps.py): prefixes of the prompt kept cached once the prompt is computed,
        under `owner`'s caps; what they did is on the output (`RequestOutput.kept`)."""
        params = params or SamplingParams()
        self.check_request(prompt_token_ids, params, salt, guide_checked=guide_grammar is not None)
        keeps = check_keeps(keeps, len(prompt_token_ids))
        turn_keep = self.hooks.check(session, len(prompt_token_ids))
        params = self.context.filled(prompt_token_ids, params)
        if params.n > self.queue_room():
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later", limit=self.config.max_queue_len)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use", param="request_id")
        prompt = list(prompt_token_ids)
        seqs = [
            SequenceState(
                next(self._seq_ids), request_id, i, prompt, params, salt, self.scheduler.step_count, owner=owner,
                sibling_salts=tuple(sibling_salts), keeps=keeps if turn_keep is None else (*keeps, turn_keep),
            )
            for i in range(params.n)
        ]
        if params.stop and params.stop_in_content and self.harmony is not None:
            for seq in seqs:
                seq.text_state.content = ContentStops(self.tokenizer, self.harmony, tuple(params.stop))
        if params.guide is not None:
            for seq in seqs:
                seq.guide_state = self.guides.new_state(params.guide, guide_grammar)
        self.requests.register(request_id, seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        self.hooks.begin(request_id, salt, session, turn_keep, seqs)
        return request_id

    def queue_room(self) -> int:
        """How many more sequences the waiting queue takes before add_request raises QueueFull."""
        return self.config.max_queue_len - len(self.scheduler.waiting)

    def check_request(self, prompt: list[int], params: SamplingParams, salt: str | None = None, *, guide_checked: bool = False) -> None:
        """Raise InvalidRequest (naming the parameter and the limit) unless the engine can run
        this request: a valid prompt that fits the context (engine/context.py, with max_tokens,
        or leaving room for one token when it is None) and the page pool beside the pins."""
        self.context.check(prompt, params)
        if self.pins:
            self.pins.check_room(prompt, -(-self.context.most_tokens(prompt, params) // self.pool.page_size), salt)
        if params.guide is not None and not guide_checked:
            self.guides.check(params.guide)  # compiles it once; add_request finds it cached

    def abort(self, request_id: str) -> RequestDelta | None:
        """End a request wherever it is; its pages go back. None if it is unknown or done."""
        self.hooks.dropped(request_id)
        return self.requests.abort(request_id)

    def abort_all(self) -> int:
        """End every request, wherever it is; all their pages go back. Returns how many ended."""
        request_ids = list(self.requests)
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
        self.context.check_prompt(list(prefix_token_ids))
        return self.pins.pin(list(prefix_token_ids), salt, owner, ttl_s)

    def unpin(self, pin_id: int, owner: Owner = None) -> bool:
        """Release `owner`'s pin; False if it is unknown, expired or another owner's (the same
        answer, so an id tells nothing)."""
        return self.pins.unpin(pin_id, owner)

    def pins_of(self, owner: Owner = None) -> list[PinnedPrefix]:
        """`owner`'s live pins, oldest first (expired ones are released first)."""
        return self.pins.owned_by(owner)

    def expire(self) -> int:
        """The one expiry pass, run before every step schedules (and by a server's timer, as
        an idle engine does not step): sessions idle past their time (first, so their tails
        are marked dead before scheduling evicts), pins and retentions past their ttl. Returns
        how many ended. Pins and retentions also expire at their own verbs' calls."""
        ended = self.hooks.expire()
        ended += self.pins.expire() if self.pins else 0
        return ended + self.tree.expire()

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
        failed = self.requests.take_failed()
        for request_id, _ in failed:
            self.hooks.dropped(request_id)
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one batch; return what is new for every request that changed (the last delta of
        a request that ended carries its whole output)."""
        try:
            deltas = self._step()
        finally:
            if self.kv_events is not None:
                self.kv_events.flush()  # even after a failed step: what the tree did stands
        if self.config.check_invariants:
            self.check_invariants()
        return deltas

    def _step(self) -> list[RequestDelta]:
        started_s = time.perf_counter()
        self.expire()
        batch = self.scheduler.schedule()
        if not batch:
            if batch.num_loaded_tokens:
                self.counters.num_steps += 1  # a step that only loaded from disk still moved on
            return []
        # The grammar masks fill on worker threads while the forward runs (rows in the order
        # ModelRunner.run samples them: the batch's sampling items).
        pending_masks = None
        if self.requests.num_guided:
            pending_masks = self.guides.start_fills([item.seq for item in batch.items if item.samples])
        self.step_times.add("schedule", time.perf_counter() - started_s)
        result = self.runner.run(batch, pending_masks)
        for phase in ("prepare", "forward", "sample"):  # where the step's time went
            self.step_times.add(phase, getattr(result, f"{phase}_s"))
        self.compute_cost.observe_batch(batch, result.forward_s)  # for the disk tier's read-or-compute choice
        postprocess_start_s = time.perf_counter()
        deltas = self.requests.postprocess(batch, result)
        self.hooks.finished(deltas)
        self.step_times.add("postprocess", time.perf_counter() - postprocess_start_s)
        return deltas

    def lookup(self, prompt_token_ids: list[int], salt: str | None = None) -> CacheLookup:
        """The prompt's tokens cached in RAM and, right after those, on disk, in full blocks;
        a pure lookup (POST /v1/cache/lookup). InvalidRequest for ids that are no token of
        this model, and for a prompt past the context (nothing longer is cached; refused
        before any id is read, so a lookup costs this thread at most a context's work)."""
        self.context.check_lookup(prompt_token_ids)
        return self.cache_view.lookup(prompt_token_ids, salt)

    def read_ahead_session(self, ref: SessionRef) -> int:
        """A session's resume, named before its request is read: its newest turn's disk blocks
        start being read (engine/sessions.py `read_ahead`); the blocks being read, 0 for a
        session the owner does not have."""
        return self.sessions.read_ahead(ref, self.cache_view.loader)

    def flush_cache(self, *, ram: bool = True, disk: bool = True) -> tuple[int, int]:
        """Drop the prefix cache's unlocked RAM pages and/or its disk blocks; (pages freed,
        blocks deleted). Running requests and pins keep theirs."""
        flushed = self.cache_view.flush(ram, disk)
        if self.kv_events is not None:
            self.kv_events.flush()
        return flushed

    def stop_kv_events(self) -> None:
        """Publish the last KV events and close their sockets (at shutdown); a no-op when off."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.tree.events.unsubscribe(self.kv_events.listen)
            self.kv_events = None

    def close(self) -> int:
        """Write what RAM caches to the disk tier, so the next start finds it warm, and release
        its directory; returns the blocks written (0 without a disk tier). The engine stays
        usable, without the disk tier; its guide compile workers stop (a later guide starts them)."""
        self.guides.compiler.close()
        return self.cache_view.close()

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats.snapshot(self.counters, self.pool, self.tree, self.scheduler, len(self.requests), self.cache_view, self.windows)

    def check_invariants(self) -> None:
        """free + evictable + in use == total, no page counted twice, refcounts explained."""
        check_page_accounting(self.pool, self.tree, self.scheduler.running, self.scheduler.waiting, self.windows)
