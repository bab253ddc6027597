"""The prefix cache's keeps and reports over layer groups, end to end on a tiny random Gemma 3
(an 8-token window on 3 of its 4 layers): a retained prefix stays a full hit at its cut under
pressure on the window pool, and greedy tokens stay transformers'."""

from __future__ import annotations

import random

from radixkv import SamplingParams
from radixkv.engine.request import Keep
from tests.helpers.engine import assert_pages_returned, hf_greedy, make_llm

MAX_NEW = 6


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 320) for _ in range(length)]


def test_a_retained_prefix_keeps_its_window_under_pressure(tiny_gemma3):
    rng = random.Random(7)
    kept = _prompt(rng, 40)  # 10 pages of 4: five windows long
    continued = kept + _prompt(rng, 5)
    flood = [_prompt(rng, 30) for _ in range(8)]
    expected = hf_greedy(tiny_gemma3, [continued], MAX_NEW)[0]
    llm = make_llm(tiny_gemma3, max_batch_tokens=16, num_window_pages=10, max_num_seqs=1)
    params = SamplingParams(max_tokens=MAX_NEW)
    first = llm.generate([kept + [5]], params, keeps=[(Keep(40, ttl_s=300.0),)])[0]
    assert first.kept is not None and first.kept.num_kept_tokens[0] == 40
    llm.generate(flood, params)  # every flood prompt needs more window pages than the pool has free
    windows = llm.engine.windows
    assert windows.pool.num_pages * 4 < sum(map(len, flood))
    # The window pool alone under pressure: every window page but those a retained cut needs.
    windows.evict(windows.evictable_pages - windows.kept_pages())
    assert windows.kept_pages() == 2 and windows.evictable_pages == 2
    warm = llm.generate([continued], params)[0]
    assert warm.num_cached_tokens == 40, "the retained cut is a full hit"
    assert warm.token_ids == expected
    assert_pages_returned(llm.engine)


def test_reports_and_lookups_take_the_windowed_cut(tiny_gemma3):
    """Once the window layers lost the KV before a prompt's end, the lookup behind cached_tokens,
    the cache report and the admission all say the same shorter cut; greedy stays transformers'."""
    rng = random.Random(11)
    prompt = _prompt(rng, 40)
    continued = prompt + _prompt(rng, 3)
    expected = hf_greedy(tiny_gemma3, [continued], MAX_NEW)[0]
    llm = make_llm(tiny_gemma3, max_batch_tokens=16, num_window_pages=10, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW)
    llm.generate([prompt + [5]], params)
    assert engine.lookup(continued).num_ram_tokens == 40
    held = engine.windows.tree_pages
    assert held and engine.cache_view.residency()["ram"].bytes == (
        engine.tree.cached_pages * engine.pool.page_nbytes + held * engine.windows.pool.page_nbytes
    ), "RAM's bytes count both groups' pages"
    engine.windows.evict(engine.windows.evictable_pages)  # the window KV alone goes
    looked_up = engine.lookup(continued).num_ram_tokens
    assert looked_up < 40 and engine.lookup(continued).num_ram_tokens == looked_up  # pure
    warm = llm.generate([continued], params)[0]
    assert warm.num_cached_tokens == looked_up, "the lookup says the cut admission takes"
    report = warm.cache_report
    assert report is not None and report.num_ram_tokens == looked_up == report.first_uncached_token
    assert report.reason == "evicted", "the full KV is cached, the window KV it needs was evicted"
    assert warm.token_ids == expected
    assert_pages_returned(engine)


def test_kv_events_publish_the_window_group(tiny_gemma3, tmp_path):
    """KV events over layer groups: group 0 (full_attention) mirrors the tree as before, and
    group 1 (sliding_window, its window in tokens) stores and removes the blocks whose window KV
    the tree holds, through window-only evictions, tree evictions and a flush."""
    from radixkv.kv_events.schema import EventBatch
    from tests.helpers.kv_subscriber import SchemaSubscriber

    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    llm = make_llm(
        tiny_gemma3, max_batch_tokens=16, num_window_pages=10, num_pages=40, kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay, kv_events_topic="t",
    )
    engine = llm.engine
    subscriber = SchemaSubscriber(endpoint, replay, topic=b"t")
    publisher = engine.kv_events.sink
    mask = (1 << 64) - 1

    def caught_up() -> None:
        assert publisher.drain()
        subscriber.catch_up(publisher.num_sent - 1)
        assert set(subscriber.blocks) == {h & mask for node in engine.tree.iter_nodes() for h in node.hashes}
        assert subscriber.group_blocks.get(1, set()) == {h & mask for h in engine.windows.held_blocks()}

    try:
        while not subscriber.poll(50):
            publisher.publish(EventBatch(ts=0.0, events=[], data_parallel_rank=0))
        assert publisher.drain()
        subscriber.catch_up(publisher.num_sent - 1)
        rng = random.Random(3)
        llm.generate([_prompt(rng, 30) for _ in range(8)], SamplingParams(max_tokens=4))
        caught_up()
        assert engine.stats().cache.evicted_pages > 0 and subscriber.group_blocks[1]
        engine.windows.evict(2)
        engine.kv_events.flush()
        caught_up()
        engine.flush_cache()
        caught_up()
        assert subscriber.blocks == {} and not subscriber.group_blocks[1]
    finally:
        subscriber.close()
        engine.stop_kv_events()


def test_the_disk_tier_keeps_window_blocks_across_a_restart(tiny_gemma3, tmp_path):
    """A window model with kv_disk_dir: a block goes to disk with its full layers' KV and, where
    RAM still held it, its window layers' KV; a restarted engine continues past the window from
    disk alone (a full hit), and a block written without its window KV cuts the disk hit at the
    last cut whose window is stored. Greedy tokens stay transformers'."""
    rng = random.Random(5)
    prompt, other = _prompt(rng, 40), _prompt(rng, 40)
    continued, other_continued = prompt + _prompt(rng, 5), other + _prompt(rng, 5)
    expected = hf_greedy(tiny_gemma3, [continued, other_continued], MAX_NEW)
    disk = str(tmp_path / "kv")
    params = SamplingParams(max_tokens=MAX_NEW)
    first = make_llm(tiny_gemma3, max_batch_tokens=16, kv_disk_dir=disk, max_num_seqs=1)
    first.generate([prompt + [5]], params)
    first.engine.flush_cache(ram=True, disk=False)  # evicted: written back with its window KV
    first.generate([other + [5]], params)
    first.engine.windows.evict(first.engine.windows.evictable_pages)  # RAM keeps full KV only
    first.engine.close()  # every RAM block to disk: `other`'s without its window KV
    second = make_llm(tiny_gemma3, max_batch_tokens=16, kv_disk_dir=disk, max_num_seqs=1)
    assert second.engine.lookup(continued).num_disk_tokens == 40
    assert second.engine.lookup(other_continued).num_disk_tokens == 0, "no stored window before any cut"
    warm = second.generate([continued], params)[0]
    assert warm.num_cached_tokens == 40 and warm.cache_report.num_disk_tokens == 40, "a full hit from disk"
    assert warm.token_ids == expected[0]
    cold = second.generate([other_continued], params)[0]
    assert cold.num_cached_tokens == 0 and cold.token_ids == expected[1]
    assert_pages_returned(second.engine)
    second.engine.close()


def test_a_session_turn_keeps_its_window_under_pressure(tiny_gemma3):
    """A session's newest turn (prompt and reply, retained when the reply ends) keeps the window
    before its cut: the next turn is a full hit after other requests fill the window pool."""
    rng = random.Random(9)
    first_prompt = _prompt(rng, 41)
    flood = [_prompt(rng, 30) for _ in range(8)]
    llm = make_llm(tiny_gemma3, max_batch_tokens=16, num_window_pages=10, max_num_seqs=1)
    params = SamplingParams(max_tokens=MAX_NEW)
    first = llm.generate([first_prompt], params, session="agent-1")[0]
    computed = len(first_prompt) + len(first.token_ids) - 1  # the reply's last token is not computed yet
    llm.generate(flood, params)
    windows = llm.engine.windows
    windows.evict(windows.evictable_pages - windows.kept_pages())
    assert windows.kept_pages() == 2, "the window before the turn's cut"
    turn = first_prompt + first.token_ids + _prompt(rng, 3)
    expected = hf_greedy(tiny_gemma3, [turn], MAX_NEW)[0]
    warm = llm.generate([turn], params, session="agent-1")[0]
    assert warm.num_cached_tokens == computed // 4 * 4, "the session's turn is a full hit at its cut"
    assert warm.token_ids == expected
    assert_pages_returned(llm.engine)
