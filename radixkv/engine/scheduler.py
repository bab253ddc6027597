"""Decides, each step, which sequences run and how many tokens each computes.

Running sequences go first (decode tokens and continuing prefill chunks); then waiting ones
are admitted in policy order (`lpm`: longest cached prefix first, with in-step deferral and
an aging bound; `fcfs`) after their priority, taken across owners (API keys) fewest-running
first, while the token, sequence and page budgets allow. When pages run out the tree is evicted
first, then the most recently admitted owner's lowest-priority sequence is preempted; a waiting
sequence short of pages may preempt its own owner's lower-priority ones. A priority never
reorders or preempts another owner's requests. The cache is KVManager's seven verbs (peek,
can_admit, load_ready, admit, reserve, release, block_hashes); where a hit lies is not seen here.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque

from radixkv.config import EngineConfig
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import Batch, ScheduledSeq, SequenceState, SeqStatus
from radixkv.engine.sampling_params import MIN_PRIORITY


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in admission order: the last is preempted first
        self.step_count = 0
        self.num_preemptions = 0
        self.num_deferrals = 0
        self.num_load_waits = 0  # admissions put off a step while their cache hit was read

    def add(self, seq: SequenceState) -> None:
        seq.arrival_step = self.step_count
        self.waiting.append(seq)

    def remove(self, seq: SequenceState) -> None:
        """Take seq out of the queues and give back its pages (finish or abort)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.release(seq)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> Batch:
        self.step_count += 1
        batch = Batch()
        token_budget = self._schedule_running(batch, self.config.max_batch_tokens)
        if not batch.preempted:
            self._admit_waiting(batch, token_budget)
        return batch

    def _schedule_running(self, batch: Batch, token_budget: int) -> int:
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or token_budget == 0:
                continue
            # The chunk ends here; what reserve loads into pages (a long hit goes on loading chunk
            # by chunk, into pages the chunk needs anyway) is not computed.
            end = seq.num_computed_tokens + min(seq.num_uncomputed_tokens, token_budget)
            reserved = self.kv.reserve(seq, end - seq.num_computed_tokens)
            while reserved is None:
                victim = self._preemption_victim(exclude=scheduled)
                self._preempt(victim, batch)
                if victim is seq:
                    break
                reserved = self.kv.reserve(seq, end - seq.num_computed_tokens)
            if reserved is None:
                continue  # seq itself was preempted
            if reserved.more_to_load:
                # The hit goes on past this chunk: computing the chunk's last few tokens would
                # end it inside a block and cut the hit short there.
                batch.num_loaded_tokens += reserved.num_loaded_tokens
                token_budget -= reserved.num_loaded_tokens
                continue
            num_new = end - seq.num_computed_tokens
            batch.items.append(ScheduledSeq(seq, num_new, num_new == seq.num_uncomputed_tokens))
            scheduled.add(seq.seq_id)
            token_budget -= num_new
        return token_budget

    def _preemption_victim(self, exclude: set[int]) -> SequenceState:
        """The owner of the latest admitted sequence gives up its lowest-priority one (the
        latest among equals): a priority weighs only against its own owner's requests."""
        candidates = [seq for seq in self.running if seq.seq_id not in exclude]
        assert candidates, "a running sequence must be left to preempt"
        owner = candidates[-1].owner
        return max((seq for seq in reversed(candidates) if seq.owner == owner), key=lambda seq: seq.params.priority)

    def _make_room(self, victim: SequenceState, batch: Batch) -> int:
        """Preempt victim for a higher-priority sequence of its owner. Nothing has run yet this
        step, so its chunk leaves the batch with its pages; returns the tokens that frees."""
        freed = sum(item.num_new_tokens for item in batch.items if item.seq is victim)
        batch.items = [item for item in batch.items if item.seq is not victim]
        self._preempt(victim, batch)
        return freed

    def _lower_priority_victim(self, seq: SequenceState, admitted_now: set[int]) -> SequenceState | None:
        """The owner's running sequence of the lowest priority below seq's (the latest admitted
        among equals), for seq to take the pages of; None where there is none. A sequence is
        preempted for priority at most once, and never in the step that admitted it, so a low
        priority (admitted overdue, see _waiting_in_policy_order) waits, never starves."""
        mine = [r for r in reversed(self.running) if r.owner == seq.owner and r.num_preemptions == 0 and r.seq_id not in admitted_now]
        victim = max(mine, key=lambda r: r.params.priority, default=None)
        return victim if victim is not None and victim.params.priority > seq.params.priority else None

    def _preempt(self, seq: SequenceState, batch: Batch) -> None:
        # Recompute later: private pages go back to the pool, the tree keeps what it cached,
        # and re-admission matches it again. Output tokens so far are kept.
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _admit_waiting(self, batch: Batch, token_budget: int) -> None:
        # Blocks that sequences already in the batch are computing: a candidate whose next
        # uncached block is among them waits a step and then hits instead of recomputing.
        computing = self._blocks_in_flight(batch)
        admitted_now: set[int] = set()
        for seq, cached in self._waiting_in_policy_order():
            if token_budget == 0:
                break
            # At the sequence budget, only a lower-priority sequence of its owner makes room.
            full = len(self.running) >= self.config.max_num_seqs
            seat = self._lower_priority_victim(seq, admitted_now) if full else None
            if full and seat is None:
                break
            if self._should_defer(seq, cached, computing):
                self.num_deferrals += 1
                continue
            if not self.kv.load_ready(seq, token_budget) and batch.items:
                # Its cache hit is being read in the background while this batch computes; it
                # is admitted once read (with nothing else to run, it waits now).
                self.num_load_waits += 1
                continue
            if seat is not None:
                token_budget += self._make_room(seat, batch)
            admitted = self._admit(seq, token_budget)
            while admitted is None and (victim := self._lower_priority_victim(seq, admitted_now)):
                token_budget += self._make_room(victim, batch)
                admitted = self._admit(seq, token_budget)
            if admitted is None:
                break
            admitted_now.add(seq.seq_id)
            num_new, loaded = admitted
            token_budget -= num_new + loaded
            if num_new == 0:
                batch.num_loaded_tokens += loaded  # only loaded this step (its hit goes on)
                continue
            batch.items.append(ScheduledSeq(seq, num_new, num_new == seq.num_uncomputed_tokens))
            computing.update(self._uncomputed_block_hashes(seq))

    def _admit(self, seq: SequenceState, token_budget: int) -> tuple[int, int] | None:
        """Look, check, then match, lock and allocate for seq's first chunk: (tokens to compute,
        tokens loaded in it); None (nothing held, nothing touched) if it can't fit, so a refusal
        has nothing to undo."""
        peek = self.kv.peek(seq)
        num_new = min(seq.num_tokens - peek.num_cached_tokens, token_budget)
        # Keep a page of headroom per running sequence so admissions don't immediately force
        # preemptions when the running ones cross a page boundary.
        if not self.kv.can_admit(peek, num_new, headroom_pages=len(self.running)):
            return None
        admitted = self.kv.admit(seq, num_new)
        assert admitted.num_cached_tokens >= peek.num_cached_tokens, "nothing ran between the look and the match"
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        # Loaded blocks went into pages the check counted for computing them; with the hit going
        # on past this chunk, nothing is computed (the next chunk loads on, see above).
        loaded = admitted.num_loaded_tokens
        return (0 if admitted.more_to_load else num_new - loaded), loaded

    def _waiting_in_policy_order(self) -> list[tuple[SequenceState, int]]:
        """Waiting sequences in the order to try them, each with its cached-token count now
        (-1 where the policy did not look), shared fairly among their owners."""
        waiting = list(self.waiting)
        if self.config.policy == "fcfs" or len(waiting) > self.config.lpm_fcfs_queue_threshold:
            in_priority = sorted(waiting, key=lambda s: s.params.priority if not self._overdue(s) else MIN_PRIORITY - 1)
            return self._shared_among_owners([(s, -1) for s in in_priority])
        overdue = [(s, -1) for s in waiting if self._overdue(s)]
        rest = [(s, self.kv.peek(s).num_cached_tokens) for s in waiting if not self._overdue(s)]
        # Stable: arrival order among equals. Priority first, then the longest hit; an overdue
        # request goes ahead of both, so a low priority waits, never starves.
        rest.sort(key=lambda pair: (pair[0].params.priority, -pair[1]))
        return self._shared_among_owners(overdue + rest)

    def _shared_among_owners(self, order: list[tuple[SequenceState, int]]) -> list[tuple[SequenceState, int]]:
        """`order` interleaved across owners: each next candidate is the first (in `order`) of
        the owner with the fewest sequences running or placed before it, ties going to the
        earlier in `order`. One key holding many requests then gets its share of the batch, not
        all of it, and every other key's next request goes ahead of its backlog. With a single
        owner (in-process use) the order is unchanged."""
        queues: dict[str | None, deque[tuple[int, tuple[SequenceState, int]]]] = {}
        for position, item in enumerate(order):
            queues.setdefault(item[0].owner, deque()).append((position, item))
        if len(queues) <= 1:
            return order
        running = Counter(seq.owner for seq in self.running)
        # (load, position of the owner's next candidate, owner): positions are unique, so the
        # owners themselves (str or None) are never compared.
        heap = [(running[owner], queue[0][0], owner) for owner, queue in queues.items()]
        heapq.heapify(heap)
        shared: list[tuple[SequenceState, int]] = []
        while heap:
            load, _, owner = heapq.heappop(heap)
            queue = queues[owner]
            shared.append(queue.popleft()[1])
            if queue:
                heapq.heappush(heap, (load + 1, queue[0][0], owner))
        return shared

    def _overdue(self, seq: SequenceState) -> bool:
        return self.step_count - seq.arrival_step > self.config.max_wait_steps

    def _should_defer(self, seq: SequenceState, cached_tokens: int, computing: set[int]) -> bool:
        if not computing or cached_tokens < 0:
            return False
        uncached = self.kv.block_hashes(seq, cached_tokens)
        return bool(uncached) and uncached[0] in computing

    def _blocks_in_flight(self, batch: Batch) -> set[int]:
        computing: set[int] = set()
        for item in batch.items:
            computing.update(self._uncomputed_block_hashes(item.seq))
        return computing

    def _uncomputed_block_hashes(self, seq: SequenceState) -> list[int]:
        return self.kv.block_hashes(seq, seq.num_computed_tokens)
