"""schemathesis, driven by the server's own OpenAPI schema, against a live server at a bounded
size: no 5xx, every error in the shape of the API it came from, and the server alive with its
page accounting intact afterwards. The larger run is scenarios/load_test.py's --fuzz."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from radixkv.server.limits import ServerLimits
from tests.helpers.live_server import KEY_A, MODEL, LiveServer, make_async_engine, serve

pytestmark = pytest.mark.fuzz

AUTH = {"Authorization": f"Bearer {KEY_A}"}
# Few examples per operation: the run stays under a minute on two cores.
EXAMPLES_PER_OPERATION = 20


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama) -> Iterator[LiveServer]:
    """A short context and tight per-key caps, so no fuzzed request can run long."""
    limits = ServerLimits(max_body_bytes=64 * 1024, max_requests_per_key=4, max_seqs_per_key=4, stream_send_timeout_s=5.0)
    engine = make_async_engine(tiny_llama, max_model_len=48, max_queue_len=16)
    with serve(engine, limits=limits) as live:
        yield live


def error_in_api_shape(ctx, response, case) -> None:
    """An error answers in the shape of the API the path belongs to."""
    if response.status_code < 400:
        return
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


def operations(live: LiveServer) -> list:
    schema = schemathesis.openapi.from_url(f"{live.base_url}/openapi.json", headers=AUTH)
    return [result.ok() for result in schema.get_all_operations()]


def test_fuzzed_requests_get_no_5xx_and_errors_in_shape(fuzz_server):
    # Each operation its own hypothesis run (schemathesis' pytest plugin does not run under
    # this pytest), so every endpoint gets its share of examples.
    checked = []
    for operation in operations(fuzz_server):

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy(), served_model=st.booleans())
        def run(case, served_model: bool) -> None:
            if served_model:  # half the cases name the served model, to get past the model check
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = MODEL
                if case.path_parameters and "model" in case.path_parameters:
                    case.path_parameters["model"] = MODEL
            case.call_and_validate(
                base_url=fuzz_server.base_url, headers=AUTH, checks=[not_a_server_error, error_in_api_shape], timeout=30
            )

        run()
        checked.append(f"{operation.method.upper()} {operation.path}")
    assert "POST /v1/chat/completions" in checked and "POST /v1/messages" in checked, checked


def test_the_server_is_alive_and_consistent_after_fuzzing(fuzz_server):
    with fuzz_server.http() as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2}).status_code == 200
    fuzz_server.assert_idle_and_consistent()
