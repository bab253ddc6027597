"""OpenAI's prompt_cache_diagnostics through the `openai` client: prompt_cache_options.
comparison_response_id answers cache_hit when nothing diverged, cache_miss with its reason
(input_changed with the missed and reusable tokens, tools_changed, prompt_cache_key_changed for
another cache partition), comparison_response_not_found for an unknown id and, alike, for
another key's; and the comparison's fingerprint store keeps no text."""

from __future__ import annotations

import openai
import pytest
from openai.types.responses.response import (
    PromptCacheDiagnosticsCacheHit,
    PromptCacheDiagnosticsCacheMiss,
    PromptCacheDiagnosticsComparisonResponseNotFound,
)

from radixkv.server.cache_diagnostics import DiagnosisStore, Digester, diverge, openai_diagnostics, anthropic_reason
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer

INSTRUCTIONS = "Answer in one short sentence."
PAGE_SIZE = 4
TOOL_A = {"type": "function", "name": "weather", "description": "Weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_B = {"type": "function", "name": "clock", "description": "Time in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def respond(live: LiveServer, input, comparison: str | None = None, key: str = KEY_A, **kwargs):
    options = {"comparison_response_id": comparison} if comparison is not None else None
    extra = {"prompt_cache_options": options} if options else {}
    return live.client(key).responses.create(
        model=MODEL, input=input, instructions=kwargs.pop("instructions", INSTRUCTIONS), max_output_tokens=2,
        temperature=0, extra_body={**extra, **kwargs.pop("extra_body", {})}, **kwargs,
    )  # fmt: skip


FIRST = [{"role": "user", "content": "What is the weather in Paris today?"},
         {"role": "assistant", "content": "Sunny and warm, all day long."},
         {"role": "user", "content": "And tomorrow?"}]


def test_nothing_diverged_is_a_cache_hit(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST)
    assert first.prompt_cache_diagnostics is None  # not asked
    longer = FIRST + [{"role": "assistant", "content": "Rain."}, {"role": "user", "content": "Thanks."}]
    second = respond(agent_server, longer, first.id)
    assert isinstance(second.prompt_cache_diagnostics, PromptCacheDiagnosticsCacheHit)
    # Chained with previous_response_id (the prompt continued from stored ids): still a hit.
    third = respond(agent_server, "More?", second.id, previous_response_id=second.id)
    assert isinstance(third.prompt_cache_diagnostics, PromptCacheDiagnosticsCacheHit)


def test_input_changed_counts_missed_and_reusable_tokens(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST)
    edited = [FIRST[0], {"role": "assistant", "content": "Cloudy, then rain by the evening."}, FIRST[2]]
    second = respond(agent_server, edited, first.id)
    diagnostics = second.prompt_cache_diagnostics
    assert isinstance(diagnostics, PromptCacheDiagnosticsCacheMiss) and diagnostics.reason == "input_changed"
    reusable = diagnostics.comparison_reusable_tokens
    assert 0 < reusable < first.usage.input_tokens
    assert diagnostics.cache_missed_tokens == second.usage.input_tokens - reusable
    assert reusable - PAGE_SIZE <= second.usage.input_tokens_details.cached_tokens < first.usage.input_tokens - PAGE_SIZE
    # Instructions are input too: changed, nothing before them is reusable.
    third = respond(agent_server, FIRST, first.id, instructions=INSTRUCTIONS + " Today is Monday.")
    assert third.prompt_cache_diagnostics.reason == "input_changed"
    assert third.prompt_cache_diagnostics.comparison_reusable_tokens == 0


def test_tools_reordered_is_tools_changed(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST, tools=[TOOL_A, TOOL_B], tool_choice="none")
    second = respond(agent_server, FIRST, first.id, tools=[TOOL_B, TOOL_A], tool_choice="none")
    assert isinstance(second.prompt_cache_diagnostics, PromptCacheDiagnosticsCacheMiss)
    assert second.prompt_cache_diagnostics.reason == "tools_changed"


def test_another_partition_is_prompt_cache_key_changed(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST)
    second = respond(agent_server, FIRST, first.id, extra_body={"cache_salt": "another-partition"})
    assert second.prompt_cache_diagnostics.reason == "prompt_cache_key_changed"
    assert second.prompt_cache_diagnostics.comparison_reusable_tokens == 0


def test_streamed_response_carries_diagnostics(agent_server: LiveServer) -> None:
    first = respond(agent_server, FIRST)
    events = list(agent_server.client().responses.create(
        model=MODEL, input=FIRST, instructions=INSTRUCTIONS, max_output_tokens=2, stream=True,
        extra_body={"prompt_cache_options": {"comparison_response_id": first.id}},
    ))
    assert isinstance(events[0].response.prompt_cache_diagnostics, PromptCacheDiagnosticsCacheHit)
    final = events[-1].response  # completed or incomplete (two tokens): the whole Response
    assert isinstance(final.prompt_cache_diagnostics, PromptCacheDiagnosticsCacheHit)


def test_unknown_and_another_keys_ids_are_not_found_alike(agent_server: LiveServer) -> None:
    mine = respond(agent_server, FIRST, key=KEY_A)
    unknown = respond(agent_server, FIRST, "resp_0123456789abcdef", key=KEY_B)
    theirs = respond(agent_server, FIRST, mine.id, key=KEY_B)
    for answer in (unknown, theirs):
        assert isinstance(answer.prompt_cache_diagnostics, PromptCacheDiagnosticsComparisonResponseNotFound)
    assert unknown.prompt_cache_diagnostics.model_dump() == theirs.prompt_cache_diagnostics.model_dump()
    # A Messages id is the key's own record too, never another key's.
    assert isinstance(respond(agent_server, FIRST, mine.id, key=KEY_A).prompt_cache_diagnostics, PromptCacheDiagnosticsCacheHit)


def test_comparison_id_is_capped(agent_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError):
        respond(agent_server, FIRST, "resp_" + "x" * 300)


# -- the store and the comparison, without a server ------------------------------------------


def _fingerprint(digester: Digester, model: str = "m", messages: tuple[str, ...] = ("a", "b"), tokens: int = 40):
    return digester.fingerprint(model=model, salt=None, system="s", tools=[], options=["auto"],
                                messages=[{"role": "user", "content": m} for m in messages], num_prompt_tokens=tokens)


def test_model_changed_in_both_shapes() -> None:
    # One server serves one model (its aliases are that model, so they change nothing), so a
    # model change is only seen by a store shared across models: checked on the comparison.
    digester = Digester()
    divergence = diverge(_fingerprint(digester, "m1"), _fingerprint(digester, "m2", tokens=50), None, None, 0)
    assert anthropic_reason(divergence) == {"type": "model_changed", "cache_missed_input_tokens": 40}
    assert openai_diagnostics(divergence) == {"type": "cache_miss", "reason": "model_changed", "cache_missed_tokens": 50,
                                              "comparison_reusable_tokens": 0}
    # A message change whose start cannot be found is unavailable, never a guess.
    unaligned = diverge(_fingerprint(digester), _fingerprint(digester, messages=("a", "c")), None, None, 0)
    assert anthropic_reason(unaligned) == {"type": "unavailable"} and openai_diagnostics(unaligned) == {"type": "unavailable"}


def test_store_is_per_owner_lru_and_capped() -> None:
    store = DiagnosisStore(max_records_per_owner=2, max_bytes_per_owner=1 << 20, max_records=3, max_bytes=1 << 20)
    fp = _fingerprint(store.digester)
    store.put("a", "1", fp)
    store.put("a", "2", fp)
    assert store.get("a", "1") is not None and store.get("b", "1") is None  # another owner's id: not found
    store.put("a", "3", fp)  # past the owner's cap its least recently used ("2") goes
    assert store.get("a", "2") is None and store.get("a", "1") is not None
    store.put("b", "1", fp)
    store.put("b", "2", fp)  # over all owners: the owner holding the most loses its least recently used
    assert len(store) == 3 and store.held_by("b") == (2, 2 * fp.num_bytes)
    # Digests and counts only: no text of the prompt is kept.
    assert not any(isinstance(v, str) for v in (fp.model, fp.system, fp.tools, *fp.messages))
