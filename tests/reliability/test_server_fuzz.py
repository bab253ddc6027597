"""Hypothesis-generated request bodies against a live server: wrong types, out-of-range
numbers, NaN and infinities, unicode, huge strings, missing and unknown fields. Every answer
is a 2xx or a 4xx in OpenAI's error shape — never a 5xx, never a hang (client timeouts) — and
a good request still succeeds afterwards."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.helpers.live_server import KEY_A, KEY_B, MODEL

TIMEOUT = httpx.Timeout(60.0, connect=10.0)
ENDPOINTS = ["/v1/chat/completions", "/v1/completions"]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
huge_text = st.builds(lambda ch, k: ch * k, st.characters(), st.integers(2_000, 300_000))
texts = st.one_of(st.text(max_size=60), st.text(st.characters(codec="utf-8"), max_size=20), huge_text)
token_ids = st.lists(st.one_of(st.integers(0, 319), st.integers(-5, 400), st.integers(-(2**70), 2**70)), max_size=40)


valid_text = st.one_of(st.text(min_size=1, max_size=40), st.text(st.characters(codec="utf-8"), min_size=1, max_size=12))
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": valid_text}
)
# Plausible values per field; together they make a request the server should serve.
VALID_COMMON = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(valid_text, st.lists(valid_text, max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=20),
    "cache_salt": st.text(max_size=40),
    "frequency_penalty": st.just(0.0),
    "logprobs": st.sampled_from([None, False]),
}
VALID_CHAT = {
    **VALID_COMMON,
    "messages": st.lists(valid_message, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 12),
}
VALID_COMPLETION = {
    **VALID_COMMON,
    "prompt": st.one_of(
        valid_text,
        st.lists(st.integers(0, 319), min_size=1, max_size=40),
        st.lists(valid_text, min_size=1, max_size=3),
        st.lists(st.lists(st.integers(0, 319), min_size=1, max_size=20), min_size=1, max_size=3),
    ),
    "echo": st.just(False),
}
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}

# What a field may be broken into: any JSON, wrong numbers, huge or odd strings.
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": texts}), max_size=3
)
odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "tool", "wizard", ""])},
    optional={"content": st.one_of(texts, content_parts, st.none(), json_values), "name": json_values},
)
broken_values = st.one_of(
    json_values,
    texts,
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    token_ids,
    st.lists(token_ids, max_size=3),
    st.lists(odd_message, max_size=3),
    st.lists(st.text(max_size=3), min_size=15, max_size=20),
)
EXTRA_FIELDS = ["tools", "response_format", "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids", "top_k", "priority", "presence_penalty", "suffix", "best_of", "unknown_field"]


@st.composite
def bodies(draw) -> tuple[str, object]:
    """A valid request with 0-3 of its fields broken, dropped or added; now and then not
    even a JSON object."""
    path = draw(st.sampled_from(ENDPOINTS))
    if draw(st.integers(0, 19)) == 0:
        return path, draw(json_values)
    fields = VALID_CHAT if path == ENDPOINTS[0] else VALID_COMPLETION
    required = REQUIRED[path]
    chosen = draw(st.sets(st.sampled_from(sorted(set(fields) - {required})), max_size=6))
    body = {name: draw(fields[name]) for name in [required, *sorted(chosen)]}
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(fields) + EXTRA_FIELDS))
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(broken_values)
    return path, body


def encode(body, ascii_only: bool) -> bytes:
    # allow_nan: NaN and Infinity are not JSON, but clients send them; the server must cope.
    return json.dumps(body, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8")


def assert_error_shape(response: httpx.Response) -> None:
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def check_response(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    event(f"status {status}")
    if status >= 400:
        response.read()
        assert_error_shape(response)
        # A full queue is the one 5xx a client may cause (and retry); everything else is a 4xx.
        assert status < 500 or (status == 503 and response.json()["error"]["code"] == "queue_full"), response.text
        return
    assert status == 200, status
    if not streamed:
        response.read()
        body = response.json()
        assert body["choices"] and body["usage"]["completion_tokens"] >= 1, body
        return
    events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    for data in events[:-1]:
        assert "error" not in json.loads(data), data


HI = [{"role": "user", "content": "hi"}]
# Edges worth trying every run: a megabyte prompt, 80k multi-byte characters, a multi-byte stop
# string while streaming, an empty prompt in a batch, NaN, and n=64 streamed.
EXAMPLES = [
    (ENDPOINTS[1], {"prompt": "x" * 1_000_000, "max_tokens": 1}),
    (ENDPOINTS[0], {"messages": [{"role": "user", "content": "é🙂" * 40_000}]}),
    (ENDPOINTS[1], {"prompt": "héllo wörld 🙂", "max_tokens": 20, "stop": "🙂", "stream": True}),
    (ENDPOINTS[1], {"prompt": [[1, 2], []], "n": 64}),
    (ENDPOINTS[0], {"messages": HI, "temperature": float("nan")}),
    (ENDPOINTS[0], {"messages": HI, "n": 64, "max_tokens": 8, "stream": True}),
]


def with_examples(test):
    for request in EXAMPLES:
        test = example(request=request, ascii_only=False, key=KEY_A)(test)
    return test


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=bodies(), ascii_only=st.booleans(), key=st.sampled_from([KEY_A, KEY_A, KEY_A, KEY_B, "sk-wrong"]))
@with_examples
def test_fuzzed_bodies_get_2xx_or_4xx(live, request, ascii_only, key):
    path, body = request
    streamed = isinstance(body, dict) and body.get("stream") is True
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with (
        httpx.Client(base_url=live.base_url, timeout=TIMEOUT) as client,
        client.stream("POST", path, content=encode(body, ascii_only), headers=headers) as response,
    ):
        check_response(response, streamed)


pin_bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(valid_text, st.lists(st.integers(0, 319), min_size=1, max_size=40), broken_values),
        "messages": st.one_of(st.lists(valid_message, min_size=1, max_size=2), broken_values),
        "cache_salt": st.one_of(st.text(max_size=20), broken_values),
        "model": st.one_of(st.just(MODEL), broken_values),
    },
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.one_of(
        st.fixed_dictionaries({"prompt": VALID_COMPLETION["prompt"]}, optional={"cache_salt": st.text(max_size=20)}),
        st.fixed_dictionaries({"messages": VALID_CHAT["messages"]}, optional={"model": st.just(MODEL)}),
        pin_bodies,
        json_values,
    ),
    pin_id=st.one_of(st.integers(-(2**70), 2**70), st.text("abcxyz0123456789-_.~%+", min_size=1, max_size=10)),
)
def test_fuzzed_pins_get_2xx_or_4xx_and_unpin(live, body, pin_id):
    with live.http(KEY_A, timeout_s=60) as client:
        headers = {"Content-Type": "application/json"}
        response = client.post("/v1/cache/pin", content=encode(body, True), headers=headers)
        event(f"pin status {response.status_code}")
        if response.status_code != 200:
            assert 400 <= response.status_code < 500, response.text
            assert_error_shape(response)
        else:
            pinned = response.json()
            assert pinned["pinned_tokens"] <= pinned["prompt_tokens"]
            assert live.http(KEY_B).delete(f"/v1/cache/pin/{pinned['pin_id']}").status_code == 404  # not B's
            assert client.delete(f"/v1/cache/pin/{pinned['pin_id']}").status_code == 200
        other = client.delete(f"/v1/cache/pin/{pin_id}")
        assert 400 <= other.status_code < 500, other.text
        if other.status_code != 405:
            assert_error_shape(other)


RAW_BODIES = [
    b'{"prompt": "a\\ud800b"}',  # a lone surrogate
    b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x"' + b" " * 100_000,
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',  # not UTF-8
    b"\x00" * 64,
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep nesting
    json.dumps({"prompt": list(range(300)) * 1000}).encode(),
]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.sampled_from(RAW_BODIES), st.binary(max_size=200)), path=st.sampled_from(ENDPOINTS))
def test_raw_bytes_get_4xx(live, raw, path):
    with live.http(timeout_s=60) as client:
        response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text[:500]
    assert_error_shape(response)


def test_a_good_request_succeeds_after_the_fuzzing(live):
    with live.http() as client:
        response = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    live.assert_idle_and_consistent()
