"""schemathesis, driven by the server's own OpenAPI schema, against a live server at a bounded
size: no 5xx, every error in the shape of the API it came from, and the server alive with its
page accounting intact afterwards. The larger run is the scenario scenarios/schema_fuzz.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from radixkv.scenarios.schema_fuzz import fuzz_agent_requests, fuzz_operations
from radixkv.server.limits import ServerLimits
from tests.helpers.live_server import KEY_A, MODEL, LiveServer, make_async_engine, serve

pytestmark = pytest.mark.fuzz

# Few cases per operation: the run stays under a minute on two cores.
EXAMPLES_PER_OPERATION = 20


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama) -> Iterator[LiveServer]:
    """A short context and tight per-key caps, so no fuzzed request can run long."""
    limits = ServerLimits(max_body_bytes=64 * 1024, max_requests_per_key=4, max_seqs_per_key=4, stream_send_timeout_s=5.0)
    engine = make_async_engine(tiny_llama, max_model_len=48, max_queue_len=16)
    with serve(engine, limits=limits) as live:
        yield live


def test_fuzzed_requests_get_no_5xx_and_errors_in_shape(fuzz_server):
    tally = fuzz_operations(fuzz_server.base_url, KEY_A, MODEL, EXAMPLES_PER_OPERATION)
    assert tally.failures == [] and tally.num_5xx == 0
    fuzzed = {name for name, _ in tally.statuses}
    assert {"POST /v1/chat/completions", "POST /v1/messages", "POST /v1/responses", "POST /v1/cache/pin"} <= fuzzed
    # Some cases got past validation and were served, not only refused.
    generation = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages")
    assert sum(tally.statuses[(name, 200)] for name in generation) > 0, sorted(tally.statuses.items())


def test_tools_and_schemas_fuzzed_on_chat_responses_and_messages(fuzz_server):
    # The deep parts a schema-driven fuzzer leaves shallow: random tools (names, parameter
    # schemas, choices, sometimes past the tool cap) and random output schemas, on all three
    # agent APIs; every answer below 500, every refusal in its API's shape.
    tally = fuzz_agent_requests(fuzz_server.base_url, KEY_A, MODEL, 3 * EXAMPLES_PER_OPERATION)
    assert tally.failures == [] and tally.num_5xx == 0
    paths = {name.split()[1] for name, _ in tally.statuses}
    assert paths == {"/v1/chat/completions", "/v1/responses", "/v1/messages"}, sorted(tally.statuses.items())


def test_the_server_is_alive_and_consistent_after_fuzzing(fuzz_server):
    with fuzz_server.http() as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2}).status_code == 200
        for pin in client.get("/v1/cache/pin").json()["data"]:  # the fuzzer's own pins
            assert client.delete(f"/v1/cache/pin/{pin['pin_id']}").status_code == 200
    fuzz_server.assert_idle_and_consistent()
