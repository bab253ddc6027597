"""Every user error gets OpenAI's error shape and the right status, and the server keeps
serving: each bad request is followed by a good one that succeeds."""

from __future__ import annotations

import openai
import pytest

from radixkv.engine.async_engine import EngineStepError, EngineStopped
from radixkv.errors import InvalidRequest, OwnerCapExceeded, QueueFull
from radixkv.server.errors import WireNames, engine_error

from tests.helpers.live_server import KEY_A, MAX_QUEUE_LEN, MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there, assistant."}]
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 80  # well over 512 tokens

# (name, path, JSON body, status, param, code)
BAD_JSON_BODIES = [
    ("negative max_tokens", CHAT, {"messages": HELLO, "max_tokens": -1}, 400, "max_tokens", None),
    ("zero max_completion_tokens", CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("huge max_tokens", CHAT, {"messages": HELLO, "max_tokens": 10**12}, 400, "max_tokens", None),
    ("max_tokens past the context", CHAT, {"messages": HELLO, "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
    ("completion past the context", COMPLETIONS, {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
    ("prompt over the context", COMPLETIONS, {"prompt": LONG_TEXT, "max_tokens": 4}, 400, "prompt", "context_length_exceeded"),
    ("chat over the context", CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages", "context_length_exceeded"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages", None),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ("tool result without its call id", CHAT, {"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages.0", None),
    ("non-text content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, None),
    ("wrong type", CHAT, {"messages": HELLO, "max_tokens": "lots"}, 400, "max_tokens", None),
    ("negative temperature", CHAT, {"messages": HELLO, "temperature": -0.5}, 400, "temperature", None),
    ("top_p zero", CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p", None),
    ("n zero", CHAT, {"messages": HELLO, "n": 0}, 400, "n", None),
    ("n too large", CHAT, {"messages": HELLO, "n": 1000}, 400, "n", None),
    ("too many stops", CHAT, {"messages": HELLO, "stop": ["x"] * 17}, 400, "stop", None),
    ("empty stop", COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("seed past 64 bits", CHAT, {"messages": HELLO, "seed": 2**70}, 400, "seed", None),
    ("token id out of range", COMPLETIONS, {"prompt": [1, 2, 99_999]}, 400, None, None),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    ("empty prompt list", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("top_logprobs over 20", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("completions logprobs over 20", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("unknown tool choice", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None),
    ("tool of unknown type", CHAT, {"messages": HELLO, "tools": [{"type": "retrieval"}]}, 400, "tools", None),
    ("required without tools", CHAT, {"messages": HELLO, "tool_choice": "required"}, 400, "tool_choice", None),
    ("json_schema without a schema", CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format", None),
    ("unknown response_format", CHAT, {"messages": HELLO, "response_format": {"type": "yaml"}}, 400, "response_format.type", None),
    ("unknown cache retention", CHAT, {"messages": HELLO, "prompt_cache_retention": "forever"}, 400, "prompt_cache_retention", None),
    ("unsupported echo", COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("logit_bias key not a token id", CHAT, {"messages": HELLO, "logit_bias": {"hello": 5}}, 400, "logit_bias", None),
    ("logit_bias past the vocabulary", CHAT, {"messages": HELLO, "logit_bias": {"1000000": 5}}, 400, "logit_bias", None),
    ("logit_bias key of 5,000 digits", CHAT, {"messages": HELLO, "logit_bias": {"7" * 5000: 5}}, 400, "logit_bias", None),
    ("logit_bias key of 10 digits", COMPLETIONS, {"prompt": "hi", "logit_bias": {"1" * 10: 5}}, 400, "logit_bias", None),
    ("logit_bias over 100", COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("logit_bias over 300 tokens", CHAT, {"messages": HELLO, "logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias", None),
    ("stop_token_ids past the vocabulary", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
    ("too many stop_token_ids", CHAT, {"messages": HELLO, "stop_token_ids": list(range(65))}, 400, "stop_token_ids", None),
    ("priority past 32 bits", COMPLETIONS, {"prompt": "hi", "priority": 2**40}, 400, "priority", None),
    ("min_tokens over max_tokens", CHAT, {"messages": HELLO, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", None),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": HELLO}, 404, "model", "model_not_found"),
    ("queue overflow", CHAT, {"messages": HELLO, "n": MAX_QUEUE_LEN + 1, "max_tokens": 2}, 503, None, "queue_full"),
]


def assert_error_shape(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(live_server) -> None:
    response = live_server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert response.choices[0].message.content is not None and response.usage.completion_tokens >= 1


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_JSON_BODIES, ids=[c[0] for c in BAD_JSON_BODIES])
def test_bad_request_then_a_good_one(live_server, name, path, body, status, param, code):
    with live_server.http() as http:
        error = assert_error_shape(http.post(path, json=body), status, param, code)
    if status == 400:
        assert error["type"] == "invalid_request_error"
    assert_still_serving(live_server)


@pytest.mark.parametrize(
    "raw", [b'{"messages": [', b"not json at all", b"[1, 2]", b"", b'"a string"'], ids=["truncated", "text", "array", "empty", "string"]
)
def test_malformed_json_is_400(live_server, raw):
    with live_server.http() as http:
        response = http.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    assert_error_shape(response, 400)
    assert_still_serving(live_server)


def test_limits_are_named_in_messages(live_server):
    with live_server.http() as http:
        message = http.post(CHAT, json={"messages": HELLO, "max_tokens": 10**12}).json()["error"]["message"]
        assert "1048576" in message
        message = http.post(COMPLETIONS, json={"prompt": LONG_TEXT}).json()["error"]["message"]
        assert "512" in message


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY_A}"}, {"Authorization": "Bearer"}],
    ids=["none", "wrong", "basic-scheme", "empty"],
)
def test_bad_key_is_401(live_server, headers):
    with live_server.http(key=None) as http:
        for method, path, body in [("POST", CHAT, {"messages": HELLO}), ("POST", COMPLETIONS, {"prompt": "x"}), ("GET", "/v1/models", None)]:
            response = http.request(method, path, json=body, headers=headers)
            assert_error_shape(response, 401, code="invalid_api_key")
            assert response.headers["www-authenticate"] == "Bearer"
    assert_still_serving(live_server)


def test_auth_is_checked_before_the_body(live_server):
    with live_server.http(key=None) as http:
        assert_error_shape(http.post(CHAT, content=b"{broken"), 401)


def test_openai_client_raises_its_own_exceptions(live_server):
    with pytest.raises(openai.AuthenticationError) as auth:
        live_server.client("sk-nope").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert auth.value.status_code == 401 and auth.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        live_server.client().chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        live_server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=-5)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as too_long:
        live_server.client().completions.create(model=MODEL, prompt="x " * 600, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.InternalServerError) as full:
        live_server.client().chat.completions.create(model=MODEL, messages=HELLO, n=MAX_QUEUE_LEN + 1, max_tokens=2)
    assert full.value.status_code == 503 and full.value.code == "queue_full"
    with pytest.raises(openai.BadRequestError):  # errors before a stream starts are plain errors too
        live_server.client().chat.completions.create(model=MODEL, messages=[], max_tokens=2, stream=True)
    assert_still_serving(live_server)


def test_unknown_routes_and_models_are_404(live_server):
    with live_server.http() as http:
        assert_error_shape(http.get("/v1/nothing-here"), 404)
        assert_error_shape(http.get("/v1/models/gpt-9"), 404, code="model_not_found")
        assert_error_shape(http.get("/v1/chat/completions"), 405)
    assert_still_serving(live_server)


@pytest.fixture(autouse=True, scope="module")
def _nothing_left_behind(live_server):
    yield
    live_server.assert_idle_and_consistent()


def test_engine_errors_map_by_their_fields_into_the_request_s_names():
    chat = WireNames(prompt="messages", max_tokens="max_completion_tokens")
    overflow = InvalidRequest("the prompt is too long", param="prompt", code="context_length_exceeded", limit=512)
    error = engine_error(overflow, chat)
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert error.message == "messages: the prompt is too long"  # the field the client sent
    error = engine_error(InvalidRequest("max_tokens must be an integer", param="max_tokens"), chat)
    assert (error.param, error.message) == ("max_completion_tokens", "max_completion_tokens: max_tokens must be an integer")
    error = engine_error(InvalidRequest("top_p must be in (0, 1]", param="top_p"), chat)
    assert (error.param, error.message, error.code) == ("top_p", "top_p must be in (0, 1]", None)
    assert engine_error(InvalidRequest("the prompt is empty", param="prompt")).param == "prompt"
    responses = WireNames(prompt="input", max_tokens="max_output_tokens", guide="text.format")
    assert engine_error(InvalidRequest("no way on", param="response_format"), responses).param == "text.format"
    assert engine_error(InvalidRequest("no way on", param="response_format"), WireNames()).param == "response_format"
    capped = engine_error(OwnerCapExceeded("this owner's pins would lock 9 KV pages", code="pin_limit_exceeded", limit=8))
    assert (capped.status, capped.type, capped.code) == (429, "rate_limit_error", "pin_limit_exceeded")


def test_engine_failures_map_to_server_errors():
    full = engine_error(QueueFull("the waiting queue is full", limit=8))
    assert (full.status, full.type, full.code, full.headers) == (503, "server_error", "queue_full", {"Retry-After": "1"})
    stopped = engine_error(EngineStopped("the engine thread died: RuntimeError('/secret/path')"))
    assert (stopped.status, stopped.code, stopped.message) == (503, "engine_down", "the engine is not running")
    failed = engine_error(EngineStepError("boom"))
    assert (failed.status, failed.code) == (500, "engine_error") and "boom" not in failed.message


def test_a_logit_bias_key_past_any_token_id_names_the_parameter_and_its_limit(live_server):
    """int() refuses past 4,300 digits (a ValueError, once a 500) and its work grows with them:
    a key longer than any token id is a 400 before int() runs."""
    with pytest.raises(openai.BadRequestError) as refused:
        live_server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"9" * 5000: 5})
    error = refused.value.body
    assert error["param"] == "logit_bias" and "at most 9 digits" in error["message"], error
    assert_still_serving(live_server)
