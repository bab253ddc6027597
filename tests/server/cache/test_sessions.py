"""Sessions over HTTP: prompt_cache_key (the openai client's extra_body) or X-Radixkv-Session (the
anthropic client's extra headers) names a session of the key's owner; GET /v1/cache/sessions
lists the caller's, DELETE releases one; another tenant can neither see, delete, resume nor evict
it, and the caps answer before any work with the limit named."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from radixkv.engine.engine import Engine
from tests.helpers.live_server import KEY_A, KEY_B, MAX_QUEUE_LEN, MODEL, LiveServer, make_async_engine, serve


@pytest.fixture(scope="module")
def live_server(tiny_llama) -> Iterator[LiveServer]:
    """This module's own server: its tenant B sends prompts the shared server's tests expect
    B never to have sent."""
    with serve(make_async_engine(tiny_llama, max_queue_len=MAX_QUEUE_LEN)) as live:
        yield live


@pytest.fixture(scope="module")
def small_server(tiny_llama) -> Iterator[LiveServer]:
    """Tight session caps: one session's worth of pages and two sessions per owner."""
    engine = make_async_engine(
        tiny_llama, max_sessions_per_owner=2, max_session_pages_per_owner=12, session_idle_s=60.0, max_session_idle_s=120.0
    )
    with serve(engine) as live:
        yield live


def chat(live: LiveServer, text: str, key: str = KEY_A, session: str | None = None, **headers: str) -> dict:
    extra_body = {"prompt_cache_key": session} if session is not None else None
    reply = live.client(key).with_options(default_headers=headers).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0, extra_body=extra_body
    )
    return reply.model_dump()


def sessions(live: LiveServer, key: str = KEY_A) -> dict[str, dict]:
    with live.http(key) as http:
        response = http.get("/v1/cache/sessions")
    assert response.status_code == 200, response.text
    return {s["key"]: s for s in response.json()["data"]}


def delete(live: LiveServer, session: str, key: str = KEY_A) -> int:
    with live.http(key) as http:
        return http.delete(f"/v1/cache/sessions/{session}").status_code


def test_prompt_cache_key_names_a_session_only_its_owner_sees_and_deletes(live_server: LiveServer) -> None:
    chat(live_server, "An agent's long system prompt, then the user's question.", session="iso-1")
    mine = sessions(live_server)["iso-1"]
    assert mine["turns"] == 1 and mine["retained_tokens"] > 0 and mine["turns_in_flight"] == 0
    assert "iso-1" not in sessions(live_server, KEY_B)
    assert delete(live_server, "iso-1", KEY_B) == 404  # as for a key that never existed
    assert delete(live_server, "never-made", KEY_A) == 404
    assert sessions(live_server)["iso-1"]["turns"] == 1  # B's attempt changed nothing
    assert delete(live_server, "iso-1") == 200
    assert delete(live_server, "iso-1") == 404
    assert "iso-1" not in sessions(live_server)
    live_server.assert_idle_and_consistent()


def test_the_same_key_is_another_session_for_another_tenant(live_server: LiveServer) -> None:
    chat(live_server, "Tenant A's conversation, turn one.", session="shared-name")
    before = live_server.engine_call(lambda engine: engine.sessions.num_resumed)
    chat(live_server, "Tenant A's conversation, turn one.", KEY_B, session="shared-name")
    assert live_server.engine_call(lambda engine: engine.sessions.num_resumed) == before  # B resumed nothing of A's
    assert sessions(live_server)["shared-name"]["turns"] == 1
    assert sessions(live_server, KEY_B)["shared-name"]["turns"] == 1
    assert delete(live_server, "shared-name", KEY_B) == 200
    assert sessions(live_server)["shared-name"]["turns"] == 1
    assert delete(live_server, "shared-name") == 200


def test_the_session_header_names_a_session_for_anthropic_messages(live_server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=live_server.base_url, api_key=KEY_A, max_retries=0, timeout=60)
    for text in ("First turn of a Messages session.", "Second turn of a Messages session."):
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": text}], extra_headers={"X-Radixkv-Session": "msg-1"}
        )
    assert sessions(live_server)["msg-1"]["turns"] == 2
    assert delete(live_server, "msg-1") == 200


def test_a_session_on_the_responses_api_and_a_resumed_turn_counts(live_server: LiveServer) -> None:
    client = live_server.client()
    first = client.responses.create(model=MODEL, input="A Responses conversation.", max_output_tokens=4, prompt_cache_key="resp-1")
    client.responses.create(
        model=MODEL, input="And its next turn.", max_output_tokens=4, prompt_cache_key="resp-1", previous_response_id=first.id
    )
    assert sessions(live_server)["resp-1"]["turns"] == 2
    assert delete(live_server, "resp-1") == 200


@pytest.mark.parametrize(
    ("headers", "body_key", "param"),
    [
        ({"X-Radixkv-Session": "x" * 1025}, None, "x-radixkv-session"),
        ({}, "x" * 1025, "prompt_cache_key"),
        ({"X-Radixkv-Session": "a"}, "b", "prompt_cache_key"),
        ({"X-Radixkv-Session-Idle-S": "30"}, None, "x-radixkv-session-idle-s"),
        ({"X-Radixkv-Session": "a", "X-Radixkv-Session-Idle-S": "-1"}, None, "x-radixkv-session-idle-s"),
        ({"X-Radixkv-Session": "a", "X-Radixkv-Session-Idle-S": "nan"}, None, "x-radixkv-session-idle-s"),
        ({"X-Dynamo-Session-ID": "x" * 1025}, None, "x-dynamo-session-id"),
        ({"X-Dynamo-Session-ID": "a", "X-Radixkv-Session": "b"}, None, "x-dynamo-session-id"),
        ({"X-Dynamo-Session-ID": "a"}, "b", "prompt_cache_key"),
        ({"X-Dynamo-Parent-Session-ID": "p"}, None, "x-dynamo-parent-session-id"),
        ({"X-Dynamo-Session-ID": "a", "X-Dynamo-Parent-Session-ID": "p" * 1025}, None, "x-dynamo-parent-session-id"),
        ({"X-Dynamo-Session-Final": "true"}, None, "x-dynamo-session-final"),
        ({"X-Dynamo-Session-ID": "a", "X-Dynamo-Session-Final": "yes"}, None, "x-dynamo-session-final"),
    ],
)
def test_malformed_session_fields_are_refused_before_any_work(live_server: LiveServer, headers: dict, body_key: str | None, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if body_key is not None:
        body["prompt_cache_key"] = body_key
    before = live_server.engine_call(lambda engine: engine.counters.num_steps)
    with live_server.http() as http:
        response = http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert live_server.engine_call(lambda engine: engine.counters.num_steps) == before


def test_an_idle_time_past_the_cap_is_refused_naming_it(small_server: LiveServer) -> None:
    with small_server.http() as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_cache_key": "long"},
            headers={"X-Radixkv-Session-Idle-S": "121"},
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "session_idle_s" and "120" in error["message"]


def test_one_tenants_sessions_cannot_evict_anothers(small_server: LiveServer) -> None:
    long_text = "Tenant B keeps a session with a long enough conversation to hold pages."
    chat(small_server, long_text, KEY_B, session="b-keeps")
    kept = sessions(small_server, KEY_B)["b-keeps"]["retained_tokens"]
    assert kept > 0
    for i in range(4):  # A opens more sessions than its count and its pages allow
        chat(small_server, f"Tenant A's session number {i} with a long conversation of its own.", session=f"a-{i}")
    mine = sessions(small_server)
    assert sorted(mine) == ["a-2", "a-3"]  # its count: the idlest made room
    assert sum(s["retained_tokens"] for s in mine.values()) <= 12 * 4  # its pages
    assert sessions(small_server, KEY_B)["b-keeps"]["retained_tokens"] == kept
    for key in mine:
        assert delete(small_server, key) == 200
    assert delete(small_server, "b-keeps", KEY_B) == 200


def test_an_idle_session_expires(small_server: LiveServer) -> None:
    now = [0.0]

    def fake_clock(engine: Engine) -> None:
        now[0] = engine.tree.now_s()
        engine.tree._now_s = lambda: now[0]

    small_server.engine_call(fake_clock)
    try:
        chat(small_server, "A turn, then a long pause.", session="idle", **{"X-Radixkv-Session-Idle-S": "30"})
        assert sessions(small_server)["idle"]["idle_s"] == 30.0
        now[0] += 29.0
        assert "idle" in sessions(small_server)
        now[0] += 1.0
        assert "idle" not in sessions(small_server)
        assert small_server.engine_call(lambda engine: engine.tree.retentions(small_server.app.state.radixkv.tenants.owner(KEY_A.encode()))) == []
    finally:
        small_server.engine_call(lambda engine: setattr(engine.tree, "_now_s", __import__("time").monotonic))


def test_a_streamed_turn_is_retained_too(live_server: LiveServer) -> None:
    stream = live_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A streamed turn of a session."}], max_tokens=4, stream=True,
        prompt_cache_key="streamed-1",
    )
    finishes = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    listed = sessions(live_server)["streamed-1"]
    assert listed["turns"] == 1 and listed["retained_tokens"] > 0
    assert delete(live_server, "streamed-1") == 200



def test_keyless_callers_are_one_owner_with_a_session_namespace_per_cache_partition(tiny_llama) -> None:
    """Issue 43: without keys every caller is one owner (one set of caps), so a session key alone
    let one caller resume, supersede or end another's. A keyless caller's cache partition
    (cache_salt) is its session namespace: the same key in two partitions is two sessions, each
    listed and deleted only with its own cache_salt; the owner's caps count both."""
    with serve(make_async_engine(tiny_llama, max_sessions_per_owner=2), keys=()) as live:

        def chat_in(cache_salt: str | None, text: str) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "prompt_cache_key": "main"}
            if cache_salt is not None:
                body["cache_salt"] = cache_salt
            with live.http(None) as http:
                assert http.post("/v1/chat/completions", json=body).status_code == 200

        def listed(cache_salt: str | None) -> list[str]:
            with live.http(None) as http:
                response = http.get("/v1/cache/sessions", params={"cache_salt": cache_salt} if cache_salt else None)
            assert response.status_code == 200, response.text
            return [s["key"] for s in response.json()["data"]]

        chat_in("app-a", "App A's agent: a long system prompt and its first question.")
        chat_in("app-b", "App B's agent, another conversation under the same session key.")
        assert live.engine_call(lambda engine: engine.sessions.num_resumed) == 0  # B resumed nothing of A's
        assert live.engine_call(lambda engine: len(engine.tree.retentions("anonymous"))) == 2  # one owner, both kept
        assert listed("app-a") == ["main"] and listed("app-b") == ["main"] and listed(None) == []
        with live.http(None) as http:
            assert http.delete("/v1/cache/sessions/main").status_code == 404  # the default namespace has none
            assert http.delete("/v1/cache/sessions/main", params={"cache_salt": "app-b"}).status_code == 200
        assert listed("app-a") == ["main"] and listed("app-b") == []
        chat_in(None, "A third keyless caller, no partition.")
        chat_in("app-c", "A fourth: past the owner's two sessions its idlest gives way.")
        assert live.engine_call(lambda engine: len(engine.sessions)) == 2  # one owner's cap over every namespace
        assert listed("app-a") == []
        live.assert_idle_and_consistent()


@pytest.fixture(scope="module")
def fanout_server(tiny_llama) -> Iterator[LiveServer]:
    """Memory pressure: a pool that holds the shared prefix and a few subagents' tails, not all."""
    with serve(make_async_engine(tiny_llama, num_pages=128)) as live:
        yield live


PLANNER = "You are the planner of a team of subagents; read the whole repository map first. " * 2


def subagent(live: LiveServer, task: str, key: str = KEY_A, **headers: str) -> dict:
    reply = live.client(key).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": PLANNER}, {"role": "user", "content": task}],
        max_tokens=4, temperature=0, extra_headers=headers,
    )  # fmt: skip
    return reply.model_dump()


def test_a_parent_and_8_final_children_leave_the_parents_prefix_hit(fanout_server: LiveServer) -> None:
    live = fanout_server
    subagent(live, "Plan the work.", **{"X-Dynamo-Session-ID": "planner"})
    for child in range(8):
        headers = {"X-Dynamo-Session-ID": f"agent-{child}", "X-Dynamo-Parent-Session-ID": "planner"}
        subagent(live, f"Subagent {child}: inspect module number {child} and report.", **headers)
        subagent(live, f"Subagent {child}: inspect module number {child} and report. Done?", **headers, **{"X-Dynamo-Session-Final": "true"})
    assert list(sessions(live)) == ["planner"]  # every final child ended
    # Another tenant's child naming "planner" finds no parent and touches nothing of A's.
    retained = sessions(live)["planner"]["retained_tokens"]
    assert retained > 0
    subagent(live, "Subagent 9 of another tenant.", KEY_B, **{"X-Dynamo-Session-ID": "b-agent", "X-Dynamo-Parent-Session-ID": "planner"})
    subagent(live, "Subagent 9 of another tenant. Done?", KEY_B, **{"X-Dynamo-Session-ID": "b-agent", "X-Dynamo-Parent-Session-ID": "planner", "X-Dynamo-Session-Final": "true"})
    assert "b-agent" not in sessions(live, KEY_B) and sessions(live)["planner"]["retained_tokens"] == retained
    prefix_tokens = live.engine_call(lambda engine: len(engine.tokenizer.encode(PLANNER)))
    reply = subagent(live, "Now merge the reports.", **{"X-Radixkv-Session": "planner"})
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= prefix_tokens  # the parent's prefix is still hit
