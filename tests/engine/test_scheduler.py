"""Scheduler decisions on real cache objects, without a model: order, deferral, aging, budgets."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from radixkv.cache.hashing import BlockHasher
from radixkv.cache.pages import PagePool
from radixkv.cache.radix import RadixTree
from radixkv.config import EngineConfig
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SequenceState, SeqStatus
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.scheduler import Scheduler

PAGE = 4
_ids = itertools.count()


def make_scheduler(num_pages: int = 64, **options) -> Scheduler:
    config = EngineConfig(page_size=PAGE, **options)
    pool = PagePool(num_pages, PAGE)
    hasher = BlockHasher(PAGE, seed=7)
    return Scheduler(config, KVManager(pool, RadixTree(pool, hasher), hasher, enable_prefix_caching=True))


def make_seq(tokens: list[int], max_tokens: int = 4) -> SequenceState:
    seq_id = next(_ids)
    return SequenceState(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=max_tokens), None, 0)


def run_step(scheduler: Scheduler):
    """Schedule, then do what the engine does after the forward (without a model)."""
    batch = scheduler.schedule()
    for item in batch.items:
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.kv.commit(item.seq)
        if item.samples:
            item.seq.output_token_ids.append(1)
    return batch


def finish(scheduler: Scheduler, seq: SequenceState) -> None:
    scheduler.remove(seq)
    seq.status = SeqStatus.FINISHED


def warm_cache(scheduler: Scheduler, tokens: list[int]) -> None:
    seq = make_seq(tokens)
    scheduler.add(seq)
    while seq.num_computed_tokens < len(tokens):
        run_step(scheduler)
    finish(scheduler, seq)


def test_lpm_admits_the_longest_cached_prefix_first():
    scheduler = make_scheduler(max_num_seqs=1)
    shared = list(range(100, 132))
    warm_cache(scheduler, shared + [1])
    cold = make_seq(list(range(200, 230)))
    hit = make_seq(shared + [2, 3])
    scheduler.add(cold)
    scheduler.add(hit)
    batch = scheduler.schedule()
    assert [item.seq for item in batch.items] == [hit]
    assert hit.num_cached_tokens == 32
    assert batch.items[0].num_new_tokens == 2  # only the uncached suffix is computed


@pytest.mark.parametrize("options", [{"policy": "fcfs"}, {"lpm_fcfs_queue_threshold": 1}], ids=["fcfs", "lpm_over_the_queue_threshold"])
def test_arrival_order_under_fcfs_and_lpm_over_the_queue_threshold(options):
    scheduler = make_scheduler(max_num_seqs=1, **options)
    shared = list(range(100, 132))
    warm_cache(scheduler, shared + [1])
    cold = make_seq(list(range(200, 230)))
    scheduler.add(cold)
    scheduler.add(make_seq(shared + [2, 3]))
    assert [item.seq for item in scheduler.schedule().items] == [cold]


def test_a_request_waits_one_step_for_a_prefix_another_is_computing():
    scheduler = make_scheduler()
    shared = list(range(100, 140))
    first, second = make_seq(shared + [1]), make_seq(shared + [2])
    scheduler.add(first)
    scheduler.add(second)
    batch = run_step(scheduler)
    assert [item.seq for item in batch.items] == [first]
    assert scheduler.num_deferrals == 1
    batch = run_step(scheduler)
    assert second in [item.seq for item in batch.items]
    assert second.num_cached_tokens == 40  # it hit instead of computing the blocks again


def test_overdue_requests_go_first_regardless_of_matches():
    scheduler = make_scheduler(max_num_seqs=1, max_wait_steps=2)
    shared = list(range(100, 132))
    warm_cache(scheduler, shared + [1])
    cold = make_seq(list(range(200, 230)))
    scheduler.add(cold)
    scheduler.step_count += 3  # cold has now waited past the bound
    scheduler.add(make_seq(shared + [2, 3]))
    assert [item.seq for item in scheduler.schedule().items] == [cold]


def test_token_budget_chunks_prefill_and_decode_shares_the_step():
    scheduler = make_scheduler(max_batch_tokens=10)
    short, long = make_seq([5, 6, 7]), make_seq(list(range(300, 325)))
    scheduler.add(short)
    scheduler.add(long)
    batch = run_step(scheduler)
    assert [(i.seq, i.num_new_tokens, i.samples) for i in batch.items] == [(short, 3, True), (long, 7, False)]
    batch = run_step(scheduler)
    # The decode token of `short` rides along with the next chunk of `long`.
    assert [(i.seq, i.num_new_tokens) for i in batch.items] == [(short, 1), (long, 9)]
    assert batch.num_tokens <= 10


def test_sequence_budget_caps_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for base in (300, 400, 500):
        scheduler.add(make_seq(list(range(base, base + 5))))
    assert len(scheduler.schedule().items) == 2
    assert len(scheduler.waiting) == 1


def test_page_budget_stops_admission_and_nothing_is_held_by_waiting():
    scheduler = make_scheduler(num_pages=6)
    seqs = [make_seq(list(range(base, base + 12))) for base in (300, 400, 500)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert len(batch.items) == 1  # 3 pages each; the headroom rule stops the second
    for seq in scheduler.waiting:
        assert seq.page_table == [] and seq.tree_node is None


def test_page_shortage_preempts_the_newest_and_it_recomputes_later():
    scheduler = make_scheduler(num_pages=6, max_num_seqs=2)
    a, b = make_seq(list(range(300, 311)), max_tokens=20), make_seq(list(range(400, 407)), max_tokens=20)
    scheduler.add(a)
    run_step(scheduler)
    scheduler.add(b)
    preempted = []
    for _ in range(8):  # a grows to 19 tokens (5 pages); b cannot keep its 3rd page
        batch = run_step(scheduler)
        preempted += batch.preempted
    assert b in preempted and a not in preempted
    assert scheduler.num_preemptions >= 1
    assert len(a.output_token_ids) > len(b.output_token_ids)


def _owned(tokens: list[int], owner: str | None, max_tokens: int = 4) -> SequenceState:
    seq = make_seq(tokens, max_tokens)
    seq.owner = owner
    return seq


def test_a_key_with_a_backlog_gets_its_share_not_the_whole_batch():
    # Key "flood" queued 12 requests before key "well" sent 2: with 4 sequence slots each key
    # gets 2, and "well" does not wait behind the backlog (before owners: flood took all 4).
    scheduler = make_scheduler(max_num_seqs=4, policy="fcfs")
    flood = [_owned([100 + i] * 6, "flood", max_tokens=50) for i in range(12)]
    well = [_owned([200 + i] * 6, "well") for i in range(2)]
    for seq in flood + well:
        scheduler.add(seq)
    run_step(scheduler)
    running = Counter(seq.owner for seq in scheduler.running)
    assert running == {"flood": 2, "well": 2}
    # A slot freed by "well" goes to "well" again while it waits, and to "flood" otherwise.
    done = well[0]
    scheduler.remove(done)
    scheduler.add(_owned([300] * 6, "well"))
    run_step(scheduler)
    assert Counter(seq.owner for seq in scheduler.running) == {"flood": 2, "well": 2}


def test_one_owner_keeps_the_policy_order_unchanged():
    # In-process callers (owner None) and a server with one key see the policy's order as it was.
    scheduler = make_scheduler(policy="fcfs")
    seqs = [_owned([400 + i] * 5, None) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    assert [s for s, _ in scheduler._waiting_in_policy_order()] == seqs


def test_owners_take_turns_fewest_running_first():
    scheduler = make_scheduler(policy="fcfs")
    a = [_owned([500 + i] * 5, "a") for i in range(4)]
    b = [_owned([600 + i] * 5, "b") for i in range(2)]
    c = [_owned([700] * 5, "c")]
    running_b = _owned([800] * 5, "b")
    scheduler.add(running_b)
    run_step(scheduler)  # b has one running now
    for seq in a + b + c:
        scheduler.add(seq)
    order = [s.owner for s, _ in scheduler._waiting_in_policy_order()]
    assert order == ["a", "c", "a", "b", "a", "b", "a"]


def test_the_scheduler_speaks_to_the_cache_in_seven_verbs_and_never_names_the_disk():
    """The scheduler sees the cache only through KVManager's verbs; where a hit lies (RAM or
    the disk tier) is the KV manager's business, so its source names no disk or prefetcher."""
    import ast
    import inspect

    from radixkv.engine import scheduler as module

    source = inspect.getsource(module)
    assert "disk" not in source.lower() and "prefetch" not in source.lower()
    used = {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "kv"
    }
    assert used <= {"peek", "can_admit", "load_ready", "admit", "reserve", "release", "block_hashes"}, used


def _prioritized(tokens: list[int], priority: int, owner: str | None = None, max_tokens: int = 4) -> SequenceState:
    seq = _owned(tokens, owner, max_tokens)
    seq.params = SamplingParams(max_tokens=max_tokens, priority=priority)
    return seq


def test_a_higher_priority_goes_ahead_of_earlier_arrivals_and_longer_hits():
    scheduler = make_scheduler(max_num_seqs=1)
    shared = list(range(100, 132))
    warm_cache(scheduler, shared + [1])
    batch_job = _prioritized(shared + [2, 3], priority=5)  # the longest hit, but a batch job
    interactive = _prioritized(list(range(200, 230)), priority=-1)
    scheduler.add(batch_job)
    scheduler.add(interactive)
    assert [item.seq for item in scheduler.schedule().items] == [interactive]


def test_a_higher_priority_preempts_its_owners_lower_one_at_the_sequence_budget():
    scheduler = make_scheduler(max_num_seqs=1)
    batch_job = _prioritized(list(range(100, 120)), priority=5, max_tokens=50)
    scheduler.add(batch_job)
    run_step(scheduler)
    interactive = _prioritized(list(range(200, 220)), priority=0)
    scheduler.add(interactive)
    batch = run_step(scheduler)
    assert [item.seq for item in batch.items] == [interactive] and batch.preempted == [batch_job]
    assert batch_job.status is SeqStatus.WAITING and batch_job.page_table == []  # its pages went back
    finish(scheduler, interactive)
    assert [item.seq for item in run_step(scheduler).items] == [batch_job]  # and it resumes


def test_a_higher_priority_preempts_its_owners_lower_one_for_pages():
    # 8 pages of 4 tokens: the batch job's 24 tokens hold 6 (+ its headroom), so the
    # interactive request's 12 tokens fit only once the batch job gives its pages back.
    scheduler = make_scheduler(num_pages=8)
    batch_job = _prioritized(list(range(100, 124)), priority=5, max_tokens=50)
    scheduler.add(batch_job)
    run_step(scheduler)
    interactive = _prioritized(list(range(200, 212)), priority=-3)
    scheduler.add(interactive)
    batch = run_step(scheduler)
    assert [item.seq for item in batch.items] == [interactive] and batch.preempted == [batch_job]


def test_a_priority_never_reorders_or_preempts_another_owners_requests():
    # Key "greedy" marks everything urgent; key "calm" sends at the default priority. Owners
    # still take turns, and calm's running request is not preempted for greedy's.
    scheduler = make_scheduler(max_num_seqs=1)
    calm = _prioritized(list(range(100, 120)), priority=0, owner="calm", max_tokens=50)
    scheduler.add(calm)
    run_step(scheduler)
    urgent = _prioritized(list(range(200, 220)), priority=-(1 << 31), owner="greedy")
    scheduler.add(urgent)
    batch = run_step(scheduler)
    assert [item.seq for item in batch.items] == [calm] and batch.preempted == []
    waiting = [_prioritized(list(range(300 + 20 * i, 320 + 20 * i)), priority=-100, owner="greedy") for i in range(3)]
    waiting.append(_prioritized(list(range(400, 420)), priority=0, owner="calm2"))
    for seq in waiting:
        scheduler.add(seq)
    order = [s.owner for s, _ in scheduler._waiting_in_policy_order()]
    assert order[:2] in (["greedy", "calm2"], ["calm2", "greedy"])


def test_an_overdue_low_priority_request_still_goes_first():
    scheduler = make_scheduler(max_num_seqs=1, max_wait_steps=2)
    old = _prioritized(list(range(100, 120)), priority=9)
    scheduler.add(old)
    scheduler.step_count += 3  # it has waited past max_wait_steps
    urgent = _prioritized(list(range(200, 220)), priority=-9, max_tokens=3)
    scheduler.add(urgent)
    assert [item.seq for item in run_step(scheduler).items] == [old]  # not preempted in the step that admitted it
    assert [item.seq for item in run_step(scheduler).items] == [urgent]  # preempted once, then
    while len(urgent.output_token_ids) < 3:
        run_step(scheduler)
    finish(scheduler, urgent)
    assert [item.seq for item in run_step(scheduler).items] == [old]
    scheduler.add(_prioritized(list(range(300, 320)), priority=-9))
    assert [item.seq for item in run_step(scheduler).items] == [old]  # never again
