"""Prompt drift named through the official clients: tools reordered and their JSON keys reordered
(Messages and Responses), a timestamp in the system prompt, a system message injected mid-
conversation, the same text tokenized to other ids; each beside the official reason (whose enum
the SDK types still parse), in radixkv's cache report too, and another key's id never found."""

from __future__ import annotations

import anthropic
import pytest
from openai.types.responses.response import PromptCacheDiagnosticsCacheMiss, PromptCacheDiagnosticsComparisonResponseNotFound

from radixkv.server.cache_diagnostics import Digester
from radixkv.server.prompt_drift import DriftDigests, drift_digests, system_drift
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer

INSTRUCTIONS = "Answer in one short sentence."
TOOL_A = {"type": "function", "name": "weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_B = {"type": "function", "name": "clock", "description": "Time in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
FIRST = [{"role": "user", "content": "What is the weather in Paris today?"},
         {"role": "assistant", "content": "Sunny and warm, all day long."},
         {"role": "user", "content": "And tomorrow?"}]


def respond(live: LiveServer, input, comparison: str | None = None, key: str = KEY_A, **kwargs):
    extra = {"prompt_cache_options": {"comparison_response_id": comparison}} if comparison else {}
    return live.client(key).responses.create(
        model=MODEL, input=input, instructions=kwargs.pop("instructions", INSTRUCTIONS), max_output_tokens=2,
        temperature=0, extra_body={**extra, "cache_report": True, **kwargs.pop("extra_body", {})}, **kwargs,
    )  # fmt: skip


def miss(response) -> PromptCacheDiagnosticsCacheMiss:
    diagnostics = response.prompt_cache_diagnostics
    assert isinstance(diagnostics, PromptCacheDiagnosticsCacheMiss), diagnostics
    return diagnostics


def test_tools_reordered_is_named_beside_tools_changed(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST, tools=[TOOL_A, TOOL_B])
    second = respond(agent_server, FIRST, first.id, tools=[TOOL_B, TOOL_A])
    diagnostics = miss(second)
    assert diagnostics.reason == "tools_changed" and diagnostics.drift == "tools_reordered"
    assert second.cache_report["drift"] == "tools_reordered"


def test_tool_schema_keys_reordered_is_named(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST, tools=[TOOL_A, TOOL_B])
    shuffled = {**TOOL_A, "parameters": dict(reversed(list(TOOL_A["parameters"].items())))}
    second = respond(agent_server, FIRST, first.id, tools=[shuffled, TOOL_B])
    assert miss(second).drift == "tool_schema_keys_reordered"
    # Another tool set is a change, not a drift.
    third = respond(agent_server, FIRST, first.id, tools=[TOOL_A])
    assert miss(third).reason == "tools_changed" and getattr(miss(third), "drift", None) is None


def test_system_timestamp_changed_is_named(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST, instructions=INSTRUCTIONS + " Now: 2026-12-06T20:03:41Z, Sunday.")
    second = respond(agent_server, FIRST, first.id, instructions=INSTRUCTIONS + " Now: 2026-12-06T20:04:12Z, Sunday.")
    assert miss(second).reason == "input_changed" and miss(second).drift == "system_timestamp_changed"
    assert second.cache_report["drift"] == "system_timestamp_changed"
    other = respond(agent_server, FIRST, first.id, instructions="Answer at length. Now: 2026-12-06T20:04:12Z, Sunday.")
    assert getattr(miss(other), "drift", None) is None


def test_system_message_injected_mid_conversation_is_named(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST)
    injected = [FIRST[0], {"role": "system", "content": "Be brief."}, *FIRST[1:]]
    second = respond(agent_server, injected, first.id)
    assert miss(second).reason == "input_changed" and miss(second).drift == "system_message_injected"
    edited = [FIRST[0], {"role": "user", "content": "Be brief."}, *FIRST[1:]]
    assert getattr(miss(respond(agent_server, edited, first.id)), "drift", None) is None


def test_same_text_other_ids_is_named_retokenized(agent_server: LiveServer) -> None:
    # A turn continued from stored ids holds the reply as generated; the same conversation sent
    # as text renders the reply's text, which this tokenizer splits otherwise.
    first = respond(agent_server, FIRST)
    chained = respond(agent_server, "And the day after?", previous_response_id=first.id)
    as_text = FIRST + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And the day after?"}]
    second = respond(agent_server, as_text, chained.id)
    diagnostics = miss(second)
    assert diagnostics.reason == "input_changed" and diagnostics.drift == "message_boundary_retokenized"
    # The ids parted inside the reply, before any text changed: the report's miss lies there too.
    assert second.cache_report["drift"] == "message_boundary_retokenized"
    assert second.cache_report["part"] == "message[3]" and second.cache_report["role"] == "assistant"
    assert diagnostics.comparison_reusable_tokens <= second.cache_report["first_uncached_token"]
    # Sent as text again, the same text renders the same ids: nothing drifted.
    again = respond(agent_server, as_text, second.id)
    assert again.prompt_cache_diagnostics.type == "cache_hit" and "drift" not in again.cache_report


def test_messages_diagnostics_name_the_drift_beside_the_reason(agent_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in (TOOL_A, TOOL_B)]
    claude = anthropic.Anthropic(base_url=agent_server.base_url, api_key=KEY_A, max_retries=0, timeout=60)

    def create(previous: str | None, tools: list, system: str) -> anthropic.types.Message:
        return claude.messages.create(
            model=MODEL, max_tokens=2, messages=messages, system=system, tools=tools, diagnostics={"previous_message_id": previous},
            extra_body={"temperature": 0, "cache_report": True},
        )  # fmt: skip

    first = create(None, tools, "Today is December 6, 2026.")
    reordered = create(first.id, tools[::-1], "Today is December 6, 2026.")
    assert isinstance(reordered.diagnostics.cache_miss_reason, anthropic.types.CacheMissToolsChanged)
    assert reordered.diagnostics.drift == "tools_reordered"
    dated = create(reordered.id, tools[::-1], "Today is December 7, 2026.")
    assert isinstance(dated.diagnostics.cache_miss_reason, anthropic.types.CacheMissSystemChanged)
    assert dated.diagnostics.drift == "system_timestamp_changed" and dated.model_extra["cache_report"]["drift"] == dated.diagnostics.drift
    # Another key naming the same message: not found, nothing named.
    with anthropic.Anthropic(base_url=agent_server.base_url, api_key=KEY_B, max_retries=0, timeout=60) as other:
        answer = other.messages.create(
            model=MODEL, max_tokens=2, messages=messages, system="Today is December 7, 2026.", tools=tools,
            diagnostics={"previous_message_id": first.id}, extra_body={"temperature": 0},
        )  # fmt: skip
    assert isinstance(answer.diagnostics.cache_miss_reason, anthropic.types.CacheMissPreviousMessageNotFound)
    assert getattr(answer.diagnostics, "drift", None) is None


def test_another_keys_id_is_never_found(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST, tools=[TOOL_A, TOOL_B])
    other = respond(agent_server, FIRST, first.id, key=KEY_B, tools=[TOOL_B, TOOL_A])
    assert isinstance(other.prompt_cache_diagnostics, PromptCacheDiagnosticsComparisonResponseNotFound)
    assert "drift" not in other.cache_report


@pytest.mark.parametrize(("before", "after", "named"), [
    ("Today is 2026-12-06.", "Today is 2026-12-07.", True),
    ("It is 20:03 UTC on Sunday, Dec 6, 2026.", "It is 09:15 UTC on Monday, Dec 7, 2026.", True),
    ("Date: 06/12/2026, time 8:05 pm", "Date: 07/12/2026, time 9:41 pm", True),
    ("Session started at 1765051421.", "Session started at 1765051999.", True),
    ("Today is 2026-12-06.", "Today is 2026-12-06!", False),
    ("You are terse.", "You are verbose.", False),
    ("Tools of version 1.2.3.", "Tools of version 1.2.4.", False),
])  # fmt: skip
def test_only_a_date_or_time_span_is_a_timestamp_drift(before: str, after: str, named: bool) -> None:
    digester = Digester()

    def digests(system: str) -> DriftDigests:
        return drift_digests(digester.of, system=system, tools=[], messages=[], token_ids=[])

    assert (system_drift(digests(before), digests(after)) == "system_timestamp_changed") is named
