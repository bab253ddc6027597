"""Sessions and forks in process: turns reuse the conversation's pages; forks running together
share their common pages (refcounts above one, fewer pages than their page tables add up to)
and give the same greedy replies as independent sessions without any cache."""

from __future__ import annotations

import pytest

from radixkv import SamplingParams
from radixkv.prompts import encode
from radixkv.sdk import GenerationError, InProcessBackend, Prompt, Session, generate_all
from radixkv.sdk.template import common_prefix
from tests.helpers.sdk import PAGE_SIZE, make_sdk_llm

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 4
PARAMS = SamplingParams(max_tokens=8)
BRANCHES = ["What is the capital of France?", "The quick brown fox?", "def add(a, b):", "Prefix caching?"]


def test_turns_append_and_reuse_the_conversation(llm):
    session = Session(llm, system=SYSTEM)
    first = session.user("Question: what is the capital of France?").generate(PARAMS)
    assert first.ok and first.num_output_tokens == len(first.token_ids) > 0
    assert session.messages[-1] == {"role": "assistant", "content": first.text}
    second = session.user("And of Italy?").generate(PARAMS)
    assert second.num_cached_tokens >= first.num_prompt_tokens // PAGE_SIZE * PAGE_SIZE
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]


class PageSharing:
    """An engine step hook: while several sequences run, how their page tables overlap."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int, int, int]] = []  # (running, table pages, distinct, max refcount)

    def __call__(self, engine) -> None:
        running = list(engine.scheduler.running)
        if len(running) < 2:
            return
        tables = [seq.page_table for seq in running]
        distinct = {page for table in tables for page in table}
        max_refcount = max(engine.pool.refcount(page) for page in distinct)
        self.samples.append((len(running), sum(map(len, tables)), len(distinct), max_refcount))


def test_forks_share_pages_and_match_independent_sessions(llm, tiny_llama):
    sharing = PageSharing()
    backend = InProcessBackend(llm, on_step=sharing)
    root = Session(backend, system=SYSTEM)
    first = root.user("Question: what is the capital of France?").generate(PARAMS)
    history = root.messages
    forks = root.fork(len(BRANCHES))
    assert all(f.messages == history for f in forks) and root.messages == history
    for fork, branch in zip(forks, BRANCHES):
        fork.user(branch)
    sharing.samples.clear()
    replies = generate_all(forks, PARAMS)

    # Every fork hit the previous turn's pages; the first fork admitted computed the rest of
    # their common prefix (the reply, re-rendered) and the others hit that too. While they
    # ran together those pages were one copy referenced by every page table (and the tree).
    common_prompt = len(common_prefix([encode(llm.tokenizer, Prompt(messages=f.messages[:-1])) for f in forks]))
    assert all(r.num_cached_tokens >= first.num_prompt_tokens // PAGE_SIZE * PAGE_SIZE for r in replies)
    assert sum(r.num_cached_tokens >= common_prompt // PAGE_SIZE * PAGE_SIZE for r in replies) >= len(BRANCHES) - 1
    together = [s for s in sharing.samples if s[0] == len(BRANCHES)]
    assert together, sharing.samples
    running, table_pages, distinct, max_refcount = together[0]
    assert distinct < table_pages
    assert table_pages - distinct >= (len(BRANCHES) - 1) * (first.num_prompt_tokens // PAGE_SIZE)
    assert max_refcount == len(BRANCHES) + 1  # each fork's page table, plus the radix tree
    assert [f.messages[-1]["content"] for f in forks] == [r.text for r in replies]

    # Independent sessions on an engine without prefix caching, one at a time.
    reference = make_sdk_llm(tiny_llama, enable_prefix_caching=False)
    for reply, branch in zip(replies, BRANCHES):
        alone = Session(reference, messages=history).user(branch).generate(PARAMS)
        assert alone.token_ids == reply.token_ids and alone.text == reply.text
        assert alone.num_cached_tokens == 0


def test_session_errors(llm, tiny_llama):
    base = make_sdk_llm(tiny_llama, chat=False)
    with pytest.raises(ValueError, match="no chat template"):
        Session(base)
    session = Session(llm, system=SYSTEM)
    with pytest.raises(ValueError, match="n=1"):
        session.user("hi").generate(SamplingParams(n=2))
    with pytest.raises(GenerationError, match="maximum context length"):
        session.user("word " * 600).generate(PARAMS)
    assert session.messages[-1]["role"] == "user"  # nothing appended on failure
    with pytest.raises(ValueError, match="positive"):
        session.fork(0)
    other = Session(make_sdk_llm(tiny_llama), system=SYSTEM).user("hi")
    with pytest.raises(ValueError, match="same backend"):
        generate_all([Session(llm).user("hi"), other])
