"""Limits the existing error tests do not reach: the exact edges of the context (a request
that fills it is served, one token more is refused), a context bounded by the page pool rather
than the model, a request that needs the whole pool, and a queue filled by many clients at once
rather than by one request's n. Each gives a clear error or a correct answer, never a crash."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from radixkv import LLM, InvalidRequest, SamplingParams
from radixkv.errors import QueueFull
from tests.helpers.engine import assert_pages_returned, make_engine, run_to_end
from tests.helpers.live_server import KEY_A, MODEL, LiveServer, make_async_engine, serve


def test_full_queue_refuses_without_side_effects_and_recovers(tiny_loaded):
    engine = make_engine(tiny_loaded, max_queue_len=3, max_num_seqs=1)
    ids = [engine.add_request([i + 1] * 9, SamplingParams(max_tokens=4)) for i in range(3)]
    with pytest.raises(QueueFull, match="3 requests"):
        engine.add_request([7] * 9, SamplingParams(max_tokens=4))
    assert engine.num_unfinished == 3 and len(engine.scheduler.waiting) == 3
    engine.step()  # one leaves the queue for the running set
    with pytest.raises(QueueFull):
        engine.add_request([8] * 9, SamplingParams(max_tokens=4, n=2))  # 2 waiting + 2 > 3
    ids.append(engine.add_request([8] * 9, SamplingParams(max_tokens=4)))
    finals = run_to_end(engine)
    assert set(finals) == set(ids) and all(f.finish_reason in ("stop", "length") for f in finals.values())
    assert_pages_returned(engine)
    ids = [engine.add_request([i + 1] * 9, SamplingParams(max_tokens=4)) for i in range(3)]
    assert set(run_to_end(engine)) == set(ids)


def test_exact_edges_of_the_context(tiny_loaded):
    engine = make_engine(tiny_loaded, max_model_len=40)
    prompt = list(range(1, 31))
    full = engine.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True))  # 30 + 10 == 40
    last = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=1, ignore_eos=True))
    with pytest.raises(InvalidRequest, match="maximum context length is 40 tokens; the request needs 41"):
        engine.add_request(prompt, SamplingParams(max_tokens=11))
    with pytest.raises(InvalidRequest, match="40"):
        engine.add_request(list(range(1, 41)), SamplingParams(max_tokens=1))
    finals = run_to_end(engine)
    assert len(finals[full].token_ids) == 10 and finals[full].finish_reason == "length"
    assert len(finals[last].token_ids) == 1 and finals[last].finish_reason == "length"
    assert_pages_returned(engine)


def test_a_request_needing_the_whole_pool_is_served_among_others(tiny_loaded):
    """20 pages of 4 tokens: a request of exactly 80 tokens takes them all, so the tree must
    give up every cached page and the other requests must wait or be preempted."""
    engine = make_engine(tiny_loaded, num_pages=20)
    with pytest.raises(InvalidRequest, match="maximum context length is 80 tokens .the KV page pool holds 20 pages"):
        engine.add_request(list(range(1, 72)), SamplingParams(max_tokens=10))
    big = (list(range(1, 71)), SamplingParams(max_tokens=10, ignore_eos=True))  # 80 tokens, 20 pages
    others = [([i] * 30 + [i + 1] * 5, SamplingParams(max_tokens=8)) for i in range(1, 6)]
    warm = [engine.add_request(p, s) for p, s in others[:3]]
    run_to_end(engine)  # the tree now holds these prompts' blocks
    assert engine.tree.cached_pages > 0 and warm
    ids = [engine.add_request(p, s) for p, s in [others[3], big, others[4]]]
    finals = run_to_end(engine)
    reference = make_engine(tiny_loaded, num_pages=256)
    ref_ids = [reference.add_request(p, s) for p, s in [others[3], big, others[4]]]
    ref_finals = run_to_end(reference)
    assert [finals[i].token_ids for i in ids] == [ref_finals[i].token_ids for i in ref_ids]
    assert len(finals[ids[1]].token_ids) == 10
    assert engine.stats().cache.evicted_pages > 0
    assert_pages_returned(engine)


def test_a_request_that_cannot_fit_beside_pins_is_refused_not_left_waiting(tiny_loaded):
    """Pinned pages are never evicted: a request needing more than the rest of the pool used to
    be accepted and then wait forever (LLM.generate spun without end)."""
    # Pin caps lifted (by default pins leave room for a full-context request, which would refuse
    # this pin): the room check beside pins is what is tested, the backstop behind the caps.
    engine = make_engine(tiny_loaded, num_pages=32, max_pinned_pages=32, max_pinned_pages_per_owner=32)
    prefix = list(range(1, 101))  # 25 full pages
    engine.add_request(prefix, SamplingParams(max_tokens=1))
    run_to_end(engine)
    pinned = engine.pin(prefix)
    assert pinned.num_pinned_tokens == 100 and engine.tree.locked_pages == 25
    too_big = (list(range(200, 230)), SamplingParams(max_tokens=20))  # 13 pages, 7 left
    with pytest.raises(InvalidRequest, match="pins hold 25 of the pool's 32, leaving 7"):
        engine.add_request(*too_big)
    assert engine.num_unfinished == 0
    fits = (list(range(200, 220)), SamplingParams(max_tokens=8))  # 7 pages
    extends = (prefix + [7] * 8, SamplingParams(max_tokens=12))  # 30 pages, 25 of them pinned
    ids = [engine.add_request(*fits), engine.add_request(*extends)]
    finals = run_to_end(engine, max_steps=500)
    assert finals[ids[1]].num_cached_tokens == 100
    reference = make_engine(tiny_loaded, num_pages=256)
    ref_ids = [reference.add_request(*fits), reference.add_request(*extends)]
    ref_finals = run_to_end(reference)
    assert [finals[i].token_ids for i in ids] == [ref_finals[i].token_ids for i in ref_ids]
    assert engine.unpin(pinned.pin_id)
    later = engine.add_request(*too_big)  # room again
    assert run_to_end(engine)[later].finish_reason in ("stop", "length")
    assert_pages_returned(engine)


def test_llm_generate_feeds_more_prompts_than_the_queue_holds(tiny_llama):
    options = dict(dtype="float32", device="cpu", page_size=4, num_pages=64, max_queue_len=3, check_invariants=True)
    llm = LLM(str(tiny_llama), **options)
    prompts = [[i + 1] * 5 for i in range(7)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=2))
    assert [o.prompt_token_ids for o in outputs] == prompts  # fed in as room freed, in order
    assert all(o.finish_reason is not None for o in outputs)
    with pytest.raises(QueueFull, match="n=4"):
        llm.generate([[1] * 5], SamplingParams(max_tokens=2, n=4))
    assert not llm.engine.has_unfinished()
    assert_pages_returned(llm.engine)


# -- over HTTP: a context bounded by the page pool, and a queue filled by many clients -----


@pytest.fixture(scope="module")
def small_server(tiny_llama) -> Iterator[LiveServer]:
    """32 pages of 4 tokens: the context is 128 tokens although the model takes 512; one
    request runs at a time and two may wait."""
    async_engine = make_async_engine(tiny_llama, num_pages=32, max_num_seqs=1, max_queue_len=2)
    with serve(async_engine, keys=(KEY_A,)) as live:
        yield live


def post(live: LiveServer, body: dict, path: str = "/v1/completions") -> httpx.Response:
    with live.http(KEY_A, timeout_s=60) as client:
        return client.post(path, json={"model": MODEL, "temperature": 0, **body})


def test_context_bounded_by_the_pool_has_exact_edges(small_server):
    with small_server.http(KEY_A) as client:  # the limit clients are told is the one enforced
        assert client.get(f"/v1/models/{MODEL}").json()["max_model_len"] == 128
    ok = post(small_server, {"prompt": list(range(1, 128)), "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1
    over = post(small_server, {"prompt": list(range(1, 128)), "max_tokens": 2})
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens" and "128" in error["message"]
    full = post(small_server, {"prompt": list(range(1, 129))})
    assert full.status_code == 400 and full.json()["error"]["param"] == "prompt"
    assert "leaves no room" in full.json()["error"]["message"]
    # No max_tokens: completions default to 16, cut to what the context has left (4 here).
    short = post(small_server, {"prompt": list(range(1, 125))})
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] <= 4
    # Chat's default is the whole remaining context.
    chat = post(small_server, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 128
    small_server.assert_idle_and_consistent()


def test_a_queue_filled_by_many_clients_gives_retryable_errors(small_server):
    results: list[httpx.Response | Exception] = [None] * 8  # type: ignore[list-item]
    barrier = threading.Barrier(len(results))

    def client(i: int) -> None:
        body = {"prompt": f"Queue test {i}: the quick brown fox", "max_tokens": 60, "stream": i % 2 == 1}
        barrier.wait()
        try:
            with small_server.http(KEY_A, timeout_s=60) as http:
                response = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
                results[i] = response
        except Exception as error:  # noqa: BLE001 - reported below
            results[i] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert all(isinstance(r, httpx.Response) for r in results), results
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, statuses
    for response in results:
        if response.status_code == 503:
            error = response.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "server_error", error
            assert response.headers["retry-after"] == "1"
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    small_server.assert_idle_and_consistent()
    again = post(small_server, {"prompt": "after the rush", "max_tokens": 3})
    assert again.status_code == 200


@pytest.fixture(scope="module")
def pin_server(tiny_llama) -> Iterator[LiveServer]:
    """48 pages of 4 tokens and a 128-token context (32 pages): pins may lock at most 16 pages,
    or a request that fills the context could never be admitted."""
    # One key may pin the whole pin room here: the cap over all owners is what is tested.
    async_engine = make_async_engine(tiny_llama, num_pages=48, max_model_len=128, max_pinned_pages_per_owner=48)
    with serve(async_engine, keys=(KEY_A,)) as live:
        yield live


def test_pins_never_make_a_valid_request_unservable(pin_server):
    """Another tenant's pins must not leave a request the server accepted waiting forever."""
    with pin_server.http(KEY_A, timeout_s=30) as client:
        too_much = client.post("/v1/cache/pin", json={"prompt": list(range(1, 97))})  # 24 pages
        assert too_much.status_code == 400 and too_much.json()["error"]["code"] == "pin_limit_exceeded"
        assert "16" in too_much.json()["error"]["message"]
        pinned = client.post("/v1/cache/pin", json={"prompt": list(range(1, 65))})  # 16 pages
        assert pinned.status_code == 200, pinned.text
        assert pinned.json()["pinned_tokens"] == 64
        try:
            # 128 tokens: the 32 pages the pins left over, all of them.
            full = client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": list(range(200, 300)) + [5] * 8, "max_tokens": 20, "temperature": 0},
            )
            assert full.status_code == 200, full.text
            assert full.json()["usage"]["total_tokens"] <= 128
            more = client.post("/v1/cache/pin", json={"prompt": list(range(150, 170))})
            assert more.status_code == 400 and more.json()["error"]["code"] == "pin_limit_exceeded"
        finally:
            assert client.delete(f"/v1/cache/pin/{pinned.json()['pin_id']}").status_code == 200
    pin_server.assert_idle_and_consistent()
