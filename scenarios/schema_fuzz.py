"""schemathesis against a live server: every operation of the server's own OpenAPI schema fuzzed
with --examples cases; then the agent APIs' deep parts, which a schema-driven fuzzer leaves
shallow: chat completions, /v1/responses and /v1/messages with random tools (names, schemas,
tool choices) and random JSON schemas as output formats, nested, enumerated, patterned or
malformed. Reports each operation's status codes, any 5xx or error outside the API's error
shape, and whether the server is alive with its pages accounted for afterwards.

    python -m radixkv.scenarios.schema_fuzz [--model DIR] [--examples 200]

The test suite runs the same loop at a bounded size (tests/server/test_schema_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


@dataclass(slots=True)
class FuzzTally:
    """Status codes per operation, and the cases that broke a check."""

    statuses: Counter = field(default_factory=Counter)  # (operation, status) -> count
    failures: list[str] = field(default_factory=list)

    @property
    def num_5xx(self) -> int:
        return sum(count for (_, status), count in self.statuses.items() if status >= 500)


def error_in_api_shape(ctx: Any, response: Any, case: Any) -> None:
    """A schemathesis check: an error answers in the shape of the API its path belongs to."""
    if response.status_code < 400:
        return
    body = response.json()
    error = body["error"]
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error", body
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body


def fuzz_operations(base_url: str, api_key: str, model_name: str, examples: int, *, seed: int | None = 0) -> FuzzTally:
    """Every operation of the schema at base_url, `examples` cases each; a failed check stops
    that operation's run and is recorded (hypothesis shrinks it first)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error

    headers = {"Authorization": f"Bearer {api_key}"}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers)
    tally = FuzzTally()
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=seed is not None, database=None)
        @given(case=operation.as_strategy(), served_model=st.booleans())
        def run(case: Any, served_model: bool) -> None:
            if served_model:  # half the cases name the served model, to get past the model check
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model_name
                if case.path_parameters and "model" in case.path_parameters:
                    case.path_parameters["model"] = model_name
            response = case.call_and_validate(
                base_url=base_url, headers=headers, checks=[not_a_server_error, error_in_api_shape], timeout=60
            )
            tally.statuses[(name, response.status_code)] += 1

        try:
            run()
        except Exception as error:  # noqa: BLE001 - recorded per operation; the others still run
            tally.failures.append(f"{name}: {type(error).__name__}: {str(error)[:2000]}")
    return tally


# -- tools and schemas ------------------------------------------------------------------------


def json_schemas() -> Any:
    """Hypothesis strategy: JSON schemas as clients write them, and as they should not (junk
    keywords, bad bounds, patterns of any text, unsatisfiable enums), nested a few levels."""
    from hypothesis import strategies as st

    names = st.text(max_size=8)
    scalars = st.one_of(
        st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(-1, 12)),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.text(max_size=8)),
        st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, st.integers(-9, 9), st.integers(-9, 9)),
        st.builds(lambda xs: {"enum": xs}, st.lists(st.one_of(st.text(max_size=5), st.integers(), st.none()), max_size=5)),
        st.dictionaries(st.sampled_from(["type", "format", "$ref", "const", "anyOf", "items"]), st.text(max_size=6), max_size=2),
    )

    def nested(children: Any) -> Any:
        return st.one_of(
            st.builds(
                lambda props, required, closed: {"type": "object", "properties": props, "required": required, "additionalProperties": closed},
                st.dictionaries(names, children, max_size=4), st.lists(names, max_size=3), st.booleans(),
            ),
            st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, children, st.integers(-1, 3)),
            st.builds(lambda options: {"anyOf": options}, st.lists(children, min_size=1, max_size=3)),
        )

    return st.recursive(scalars, nested, max_leaves=10)


def agent_requests(model_name: str) -> Any:
    """Hypothesis strategy: (path, body) of a chat, Responses or Messages request with random
    tools and output formats; the tool count sometimes runs past every cap."""
    from hypothesis import strategies as st

    tool_names = st.one_of(st.text(max_size=12), st.text(min_size=60, max_size=140), st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
    schemas = json_schemas()
    counts = st.one_of(st.integers(0, 4), st.just(129))
    tools = counts.flatmap(lambda n: st.lists(st.tuples(tool_names, schemas, st.booleans()), min_size=n, max_size=n))
    max_tokens = st.integers(1, 12)

    def chat(tools: list, fmt: dict | None, choice: str, strict: bool, tokens: int) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": model_name, "messages": [{"role": "user", "content": "Go."}], "max_tokens": tokens}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": n, "parameters": p, "strict": s}} for n, p, s in tools]
            body["tool_choice"] = choice if choice != "named" else {"type": "function", "function": {"name": tools[0][0]}}
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": fmt, "strict": strict}}
        return "/v1/chat/completions", body

    def responses(tools: list, fmt: dict | None, choice: str, strict: bool, tokens: int) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": model_name, "input": "Go.", "max_output_tokens": tokens, "store": False}
        if tools:
            body["tools"] = [{"type": "function", "name": n, "parameters": p, "strict": s} for n, p, s in tools]
            body["tool_choice"] = choice if choice != "named" else {"type": "function", "name": tools[0][0]}
        if fmt is not None:
            body["text"] = {"format": {"type": "json_schema", "name": "out", "schema": fmt, "strict": strict}}
        return "/v1/responses", body

    def messages(tools: list, fmt: dict | None, choice: str, strict: bool, tokens: int) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": model_name, "max_tokens": tokens, "messages": [{"role": "user", "content": "Go."}]}
        if tools:
            body["tools"] = [{"name": n, "input_schema": p} for n, p, _ in tools]
            anthropic_choice = {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}
            body["tool_choice"] = anthropic_choice.get(choice) or {"type": "tool", "name": tools[0][0]}
        return "/v1/messages", body

    return st.builds(
        lambda build, *args: build(*args),
        st.sampled_from([chat, responses, messages]),
        tools,
        st.one_of(st.none(), schemas),
        st.sampled_from(["auto", "required", "none", "named"]),
        st.booleans(),
        max_tokens,
    )


def fuzz_agent_requests(base_url: str, api_key: str, model_name: str, examples: int, *, seed: int | None = 0) -> FuzzTally:
    """`examples` requests from `agent_requests`, each answered below 500 and, when refused,
    in its API's error shape; the first failure is shrunk and recorded."""
    import httpx
    from hypothesis import HealthCheck, given, settings

    tally = FuzzTally()
    headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=seed is not None, database=None)
        @given(request=agent_requests(model_name))
        def run(request: tuple[str, dict]) -> None:
            path, body = request
            response = client.post(path, json=body)
            tally.statuses[(f"POST {path} (tools, schemas)", response.status_code)] += 1
            assert response.status_code < 500, (path, response.status_code, response.text[:500])
            if response.status_code >= 400:
                answer = response.json()
                if path == "/v1/messages":
                    assert answer["type"] == "error", answer
                assert isinstance(answer["error"]["message"], str) and isinstance(answer["error"]["type"], str), answer

        try:
            run()
        except Exception as error:  # noqa: BLE001 - recorded; the caller reports it
            tally.failures.append(f"tools and schemas: {type(error).__name__}: {str(error)[:2000]}")
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=256, help="a short context keeps each case quick")
    parser.add_argument("--examples", type=int, default=200, help="cases per operation")
    parser.add_argument("--out", default="out/schema_fuzz")
    args = parser.parse_args(argv)

    import httpx

    from radixkv.cli import served_model_name
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app
    from radixkv.server.limits import ServerLimits
    from radixkv.server.thread import ServerThread

    config = EngineConfig(model=args.model, dtype=args.dtype, num_pages=args.num_pages, max_model_len=args.max_model_len)
    async_engine = AsyncEngine.build(lambda: Engine(config))
    model_name = served_model_name(args.model)
    key = "sk-fuzz-" + secrets.token_hex(8)
    limits = ServerLimits(max_body_bytes=1 << 20, max_requests_per_key=8, max_seqs_per_key=16, stream_send_timeout_s=10.0)
    try:
        with ServerThread(create_app(async_engine, api_keys=[key], model_name=model_name, limits=limits), HOST) as server:
            tally = fuzz_operations(server.base_url, key, model_name, args.examples, seed=None)
            deep = fuzz_agent_requests(server.base_url, key, model_name, args.examples * 3, seed=None)
            tally.statuses.update(deep.statuses)
            tally.failures += deep.failures
            alive = httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        check_error = _page_check(async_engine)
    finally:
        async_engine.shutdown()
    print("| operation | status | cases")
    print("|-----------|--------|------")
    for (name, status), count in sorted(tally.statuses.items()):
        print(f"| {name} | {status} | {count}")
    for failure in tally.failures:
        print("  FAILED", failure)
    ok = not tally.failures and tally.num_5xx == 0 and alive and check_error is None
    print(f"5xx: {tally.num_5xx}; failed checks: {len(tally.failures)}; alive after: {alive}; "
          f"pages: {'ok' if check_error is None else check_error}; verdict: {'PASS' if ok else 'FAIL'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"ok": ok, "alive": alive, "page_check": check_error, "failures": tally.failures,
               "statuses": [{"operation": n, "status": s, "cases": c} for (n, s), c in sorted(tally.statuses.items())]}
    (out / "schema_fuzz.json").write_text(json.dumps(payload, indent=2))
    return 0 if ok else 1


def _page_check(async_engine: Any) -> str | None:
    """None when nothing is left running and every page is free or cached, else what is wrong."""
    import time

    deadline = time.monotonic() + 60
    while async_engine.stats().num_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)

    def check(engine: Any) -> str | None:
        try:
            engine.check_invariants()
            assert engine.num_unfinished == 0, f"{engine.num_unfinished} requests left"
        except AssertionError as error:
            return str(error)
        return None

    return async_engine.call(check).result(60)


if __name__ == "__main__":
    sys.exit(main())
