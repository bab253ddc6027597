"""The HTTP backend against a live `radixkv serve` on the same tiny model: the same results as
in process, cache hits reported per row, per-row errors, sessions, and pins over
/v1/cache/pin (owned by the key that made them)."""

from __future__ import annotations

import httpx
import pytest

from radixkv import SamplingParams
from radixkv.sdk import GenerationError, HTTPBackend, PromptTemplate, Session, as_backend, generate_all, pin, run_batch

from radixkv.server.limits import ServerLimits
from tests.helpers.live_server import KEY_A, KEY_B, make_async_engine, serve
from tests.helpers.sdk import EXAMPLES, NUM_PAGES, PAGE_SIZE, five_shot, make_sdk_llm, rows

PARAMS = SamplingParams(max_tokens=6)


def template(tag: str, chat: bool | None = None) -> PromptTemplate:
    """A 5-shot template whose system prompt no other test has cached on the server."""
    base = five_shot()
    return PromptTemplate(system=f"[{tag}] {base.system}", examples=EXAMPLES, user=base.user, chat=chat)


def test_backend_is_chosen_by_what_is_passed(live_server, llm):
    assert isinstance(as_backend(live_server.client()), HTTPBackend)
    assert isinstance(as_backend(live_server.base_url, api_key=KEY_A), HTTPBackend)
    assert as_backend(llm).identity is llm
    with pytest.raises(TypeError, match="radixkv.LLM"):
        as_backend(42)


@pytest.mark.parametrize(("with_tokenizer", "chat"), [(False, None), (True, None), (False, False)])
def test_http_gives_the_same_results_as_in_process(live_server, tiny_llama, with_tokenizer, chat):
    """Chat templates go to /v1/chat/completions, plain text (chat=False) to /v1/completions."""
    tpl = template(f"http {with_tokenizer} {chat}", chat=chat)
    data = rows(20, seed=3)
    local = make_sdk_llm(tiny_llama)
    expected = run_batch(local, tpl, data, PARAMS, progress=False)
    tokenizer = local.tokenizer if with_tokenizer else None
    backend = HTTPBackend(live_server.client(), tokenizer=tokenizer, max_concurrency=4)
    results = run_batch(backend, tpl, data, PARAMS, progress=False)

    assert all(r.ok for r in results)
    assert [r.text for r in results] == [e.text for e in expected]
    assert [r.num_prompt_tokens for r in results] == [e.num_prompt_tokens for e in expected]
    assert [r.num_output_tokens for r in results] == [e.num_output_tokens for e in expected]
    shared = len(tpl.shared_token_ids(local.tokenizer, chat=chat is None))
    assert results[0].num_cached_tokens < shared // PAGE_SIZE * PAGE_SIZE  # the first row computes the template
    assert all(r.num_cached_tokens >= shared // PAGE_SIZE * PAGE_SIZE for r in results[1:])


def test_a_bad_row_fails_alone_over_http(live_server):
    tpl = template("bad row")
    backend = HTTPBackend(live_server.base_url, api_key=KEY_A)  # a base URL without /v1 works too
    results = run_batch(backend, tpl, ["Fine.", "word " * 600, "Awful."], PARAMS, progress=False)
    assert results[0].ok and results[2].ok
    assert results[1].error.startswith("HTTP 400") and "maximum context length" in results[1].error


def _converse(backend, system: str, branches: list[str]):
    session = Session(backend, system=system)
    first = session.user("Question: what is the capital of France?").generate(PARAMS)
    forks = session.fork(len(branches))
    for fork, branch in zip(forks, branches):
        fork.user(branch)
    return first, generate_all(forks, PARAMS), forks


def test_sessions_and_forks_over_http_match_in_process(tiny_llama):
    """With exact continuation off on both sides, a session re-renders its earlier replies from
    their text in process as over HTTP (on, both put back the ids a reply was generated as, which
    the tiny model's byte-token replies do not re-tokenize to: the test below,
    tests/sdk/test_exact_continuation.py and tests/server/test_continuation.py)."""
    system = "You are a helpful assistant (http session). " * 3
    branches = ["What is the capital of France?", "The quick brown fox?", "Prefix caching?"]
    first_local, replies_local, _ = _converse(make_sdk_llm(tiny_llama, exact_continuation=False), system, branches)
    engine = make_async_engine(tiny_llama, page_size=PAGE_SIZE, num_pages=NUM_PAGES, seed=0)
    with serve(engine, limits=ServerLimits(exact_continuation=False)) as server:
        first_http, replies_http, forks = _converse(server.client(), system, branches)
    assert first_http.text == first_local.text
    assert [r.text for r in replies_http] == [r.text for r in replies_local]
    assert all(r.num_cached_tokens >= first_http.num_prompt_tokens // PAGE_SIZE * PAGE_SIZE for r in replies_http)
    assert forks[0].messages[-1] == {"role": "assistant", "content": replies_http[0].text}


def test_sessions_with_exact_continuation_match_in_process(tiny_llama):
    """Exact continuation on in process and over HTTP (both defaults): the same prompts, so the
    same replies, and every fork's turn hits the first turn, its reply as generated."""
    system = "You are a helpful assistant (exact http session). " * 3
    branches = ["What is the capital of France?", "Prefix caching?"]
    first_local, replies_local, _ = _converse(make_sdk_llm(tiny_llama), system, branches)
    engine = make_async_engine(tiny_llama, page_size=PAGE_SIZE, num_pages=NUM_PAGES, seed=0)
    with serve(engine) as server:
        first_http, replies_http, _ = _converse(server.client(), system, branches)
    assert first_http.text == first_local.text
    assert [r.text for r in replies_http] == [r.text for r in replies_local]
    assert [r.num_prompt_tokens for r in replies_http] == [r.num_prompt_tokens for r in replies_local]
    turn = first_http.num_prompt_tokens + first_http.num_output_tokens
    assert all(r.num_cached_tokens >= first_http.num_prompt_tokens // PAGE_SIZE * PAGE_SIZE for r in replies_http + replies_local)
    assert [r.num_cached_tokens >= (turn - 1) // PAGE_SIZE * PAGE_SIZE for r in replies_http] == [
        r.num_cached_tokens >= (turn - 1) // PAGE_SIZE * PAGE_SIZE for r in replies_local
    ]

def test_pin_over_http(live_server, tiny_llama):
    tpl = template("pinned")
    local = make_sdk_llm(tiny_llama)
    shared = len(tpl.shared_token_ids(local.tokenizer, chat=True))
    client = live_server.client()

    def locked_pages() -> int:
        return live_server.engine_call(lambda engine: engine.tree.locked_pages)

    before = locked_pages()
    handle = pin(HTTPBackend(client, tokenizer=local.tokenizer), tpl)  # as token ids
    assert handle.num_prompt_tokens == shared and handle.num_pinned_tokens == shared // PAGE_SIZE * PAGE_SIZE
    assert locked_pages() == before + handle.num_pinned_tokens // PAGE_SIZE
    [row] = run_batch(client, tpl, ["Pinned?"], PARAMS, progress=False)
    assert row.num_cached_tokens >= handle.num_pinned_tokens

    # Only the key that pinned may unpin; others are told it does not exist.
    other = httpx.delete(f"{live_server.base_url}/v1/cache/pin/{handle.pin_id}", headers={"Authorization": f"Bearer {KEY_B}"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    assert handle.unpin() and locked_pages() == before
    assert not HTTPBackend(client).unpin(handle.pin_id)  # already gone

    with pin(client, tpl) as by_messages:  # no tokenizer: the system prompt and examples as messages
        assert 0 < by_messages.num_pinned_tokens <= by_messages.num_prompt_tokens < shared
    assert locked_pages() == before


def test_pin_endpoint_errors(live_server):
    http = httpx.Client(base_url=live_server.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    both = http.post("/v1/cache/pin", json={"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    too_long = http.post("/v1/cache/pin", json={"prompt": list(range(1, 300)) * 2})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    wrong_model = http.post("/v1/cache/pin", json={"model": "nope", "prompt": "a"})
    assert wrong_model.status_code == 404
    assert httpx.post(f"{live_server.base_url}/v1/cache/pin", json={"prompt": "a"}).status_code == 401
    with pytest.raises(GenerationError, match="HTTP 400"):
        pin(live_server.client(), "")


def test_pins_may_lock_at_most_half_the_pool(live_server):
    """Over all keys together (one key alone may pin a quarter of the pool)."""
    backend = HTTPBackend(live_server.client())
    prefixes = [[(7 * k + i) % 300 + 1 for i in range(500)] for k in range(3)]  # 125 pages each, of 512
    handles = []
    try:
        handles.append(pin(backend, prefixes[0]))
        handles.append(pin(HTTPBackend(live_server.client(KEY_B)), prefixes[1]))
        with pytest.raises(GenerationError, match="at most 256 pinned pages"):
            pin(backend, prefixes[2])
        assert live_server.engine_call(lambda engine: engine.tree.locked_pages) >= 250
    finally:
        for handle in handles:
            handle.unpin()
    assert pin(backend, prefixes[2]).unpin()  # room again once the others are gone


@pytest.mark.parametrize("chat", [None, False])
def test_guides_and_token_controls_travel_over_http_as_in_process(live_server, tiny_llama, chat):
    # Every SamplingParams field the engine takes reaches the server: a JSON schema on both
    # endpoints (completions took it silently unguided before), a regex, and vLLM's extensions.
    from radixkv import GrammarGuide, JsonGuide

    tpl = template(f"guides {chat}", chat=chat)
    data = rows(3, seed=5)
    local = make_sdk_llm(tiny_llama)
    backend = HTTPBackend(live_server.client(), max_concurrency=2)
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    for params in (
        SamplingParams(max_tokens=30, guide=JsonGuide(schema)),
        SamplingParams(max_tokens=30, guide=GrammarGuide("regex", "(yes|no)!")),
        SamplingParams(max_tokens=7, ignore_eos=True, min_tokens=7, logit_bias={9: 5.0}, top_k=3),
    ):
        expected = run_batch(local, tpl, data, params, progress=False)
        assert [r.text for r in run_batch(backend, tpl, data, params, progress=False)] == [e.text for e in expected]
