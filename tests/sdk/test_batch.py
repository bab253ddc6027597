"""run_batch, warm and pin in process: a 5-shot template whose rows after the first are
served the template's pages from the cache, per-row failures, progress, and pins that survive
eviction pressure."""

from __future__ import annotations

import random

import pytest

from radixkv import SamplingParams
from radixkv.prompts import encode
from radixkv.sdk import GenerationError, InProcessBackend, PromptTemplate, pin, run_batch, warm

from tests.helpers.sdk import EXAMPLES, PAGE_SIZE, SYSTEM, five_shot, make_sdk_llm, rows

PARAMS = SamplingParams(max_tokens=6)


def full_blocks(num_tokens: int) -> int:
    return num_tokens // PAGE_SIZE * PAGE_SIZE


def test_five_shot_rows_after_the_first_hit_the_template(llm, tiny_llama):
    template = five_shot()
    shared = len(template.shared_token_ids(llm.tokenizer, chat=True))
    assert shared > 300  # the system prompt and five examples
    data = rows(24)
    results = run_batch(llm, template, data, PARAMS, progress=False)

    assert all(r.ok for r in results)
    assert results[0].num_cached_tokens == 0  # a cold cache: the first row computes the template
    for r in results[1:]:
        assert r.num_cached_tokens >= full_blocks(shared)
    stats = llm.stats()
    assert stats.counters.num_prompt_tokens_computed <= sum(r.num_prompt_tokens for r in results) - 23 * full_blocks(shared)

    # Row order, and exactness: the same greedy tokens as each row alone without any cache.
    reference = make_sdk_llm(tiny_llama, enable_prefix_caching=False)
    expected = reference.chat([template.messages(row) for row in data], PARAMS)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.text for r in results] == [e.text for e in expected]
    assert [r.num_prompt_tokens for r in results] == [e.num_prompt_tokens for e in expected]


def test_progress_bar_shows_the_running_hit_rate(llm, capsys):
    run_batch(llm, five_shot(), rows(6), PARAMS, progress=True)
    err = capsys.readouterr().err
    assert "run_batch" in err and "6/6" in err
    assert "cache hit" in err and "cache hit 0%" not in err.rsplit("\r", 1)[-1]


def test_one_bad_row_fails_alone(llm):
    template = PromptTemplate(system=SYSTEM, examples=EXAMPLES[:2], user="Review: {review}")
    data = [{"review": "Fine."}, {"review": "word " * 600}, {"text": "no review field"}, {"review": "Awful."}]
    results = run_batch(llm, template, data, PARAMS, progress=False)
    assert results[0].ok and results[3].ok
    assert "maximum context length is 512" in results[1].error
    assert "missing field(s) ['review']" in results[2].error
    assert results[1].text == "" and results[1].num_prompt_tokens == 0
    alone = run_batch(llm, template, [data[0], data[3]], PARAMS, progress=False)
    assert [r.token_ids for r in alone] == [results[0].token_ids, results[3].token_ids]
    llm.engine.check_invariants()
    assert not llm.engine.has_unfinished()


def test_more_rows_than_the_queue_holds(tiny_llama):
    llm = make_sdk_llm(tiny_llama, max_queue_len=4)
    template = PromptTemplate(system=SYSTEM, examples=EXAMPLES[:1], user="Review: {review}")
    results = run_batch(llm, template, rows(10), SamplingParams(max_tokens=2), progress=False)
    assert all(r.ok for r in results) and len(results) == 10


def test_warm_computes_the_shared_prefix_ahead(llm):
    template = five_shot()
    shared = template.shared_token_ids(llm.tokenizer, chat=True)
    warmed = warm(llm, template)
    assert warmed.num_prompt_tokens == len(shared) and warmed.num_cached_tokens == 0
    results = run_batch(llm, template, rows(3), PARAMS, progress=False)
    assert all(r.num_cached_tokens >= full_blocks(len(shared)) for r in results)  # the first row too


def traffic(llm, count: int, seed: int) -> None:
    """Distinct random prompts: each fills pages that push older, unlocked ones out."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 320) for _ in range(60)] for _ in range(count)]
    for prompt in prompts:
        llm.generate(prompt, SamplingParams(max_tokens=2))


def test_a_pinned_prefix_survives_eviction_pressure(tiny_llama):
    # lru: the default slru would keep the unpinned prefix too (it served hits, one-off traffic
    # never did), which hides whether the pin was what kept it.
    # The prefix is over a third of the pool: past the default pin caps (a quarter of the pool per
    # owner, and room for a full-context request, the whole of this pool), so they are lifted.
    llm = make_sdk_llm(tiny_llama, num_pages=96, eviction_policy="lru", max_pinned_pages=96, max_pinned_pages_per_owner=96)
    template = PromptTemplate(system=SYSTEM, examples=EXAMPLES[:1], user="Review: {review}")
    shared = template.shared_token_ids(llm.tokenizer, chat=True)
    assert 30 <= len(shared) // PAGE_SIZE <= 45
    backend = InProcessBackend(llm)

    with pin(backend, template) as pinned:
        assert pinned.num_pinned_tokens == full_blocks(len(shared)) and pinned.num_prompt_tokens == len(shared)
        assert llm.engine.tree.locked_pages == pinned.num_pinned_tokens // PAGE_SIZE
        traffic(llm, 20, seed=1)  # ~300 pages of other prompts through a 96-page pool
        assert llm.stats().cache.evicted_pages > 96
        [hit] = run_batch(backend, template, ["Still here?"], PARAMS, progress=False)
        assert hit.num_cached_tokens >= pinned.num_pinned_tokens
    assert pinned.released and not pinned.unpin()
    assert llm.engine.tree.locked_pages == 0

    traffic(llm, 20, seed=2)  # unpinned, the prefix is evictable like any other (under lru, see above)
    [miss] = run_batch(backend, template, ["Gone now?"], PARAMS, progress=False)
    assert miss.num_cached_tokens < pinned.num_pinned_tokens
    llm.engine.check_invariants()


def test_pin_accepts_text_token_ids_and_messages(llm):
    template = five_shot()
    ids = template.shared_token_ids(llm.tokenizer, chat=True)
    prefix_messages = template.shared_prompt(chat=True).messages
    text = llm.tokenizer.decode(ids)
    for prefix, length in [
        (ids, len(ids)),
        (prefix_messages, len(encode(llm.tokenizer, template.shared_prompt(chat=True)))),
        (text, len(llm.encode(text))),
    ]:
        handle = pin(llm, prefix)
        assert handle.num_prompt_tokens == length and handle.num_pinned_tokens == full_blocks(length)
        assert handle.unpin()
    assert llm.engine.tree.locked_pages == 0
    with pytest.raises(TypeError):
        pin(llm, 3.5)


def test_in_process_pins_get_the_caps_http_pins_get(llm):
    """One owner in process, as one key over HTTP: its pins lock at most a quarter of the pool
    (128 of 512 pages here), and a pin past that is refused, locking nothing."""
    first = pin(llm, [1 + i % 300 for i in range(400)])  # 100 pages
    assert first.num_pinned_tokens == 400
    with pytest.raises(GenerationError, match="may pin at most 128"):
        pin(llm, [1 + (i + 7) % 300 for i in range(400)])
    assert llm.engine.tree.locked_pages == 100
    assert first.unpin() and llm.engine.tree.locked_pages == 0
