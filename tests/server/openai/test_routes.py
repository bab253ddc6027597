"""The server through the official openai client: chat and completions, streaming and not,
stops, n, seeds, multi-turn cache reuse, tenant isolation, models, health and metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.live_server import KEY_A, KEY_B, MODEL, metric_values

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3


def chat(client, content: str, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_models_health_and_auth_free_probes(live_server):
    client = live_server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{live_server.base_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_chat_completion(live_server):
    response = chat(live_server.client(), "The quick brown fox jumps over the lazy dog.", max_tokens=8)
    assert response.object == "chat.completion" and response.model == MODEL
    [choice] = response.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= cached(response) < usage.prompt_tokens


def test_chat_stream_matches_non_stream(live_server):
    client = live_server.client()
    prompt = "Streaming test: the quick brown fox jumps over the lazy dog."
    whole = chat(client, prompt, max_tokens=16)
    chunks = list(chat(client, prompt, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert cached(usage_chunk) > 0  # the same prompt a second time
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage no chunk carries usage
    plain = list(chat(client, prompt, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices


def test_completions_stream_and_not(live_server):
    client = live_server.client()
    prompt = "def add(a, b):\n    return a + b\n" * 2
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and len(whole.choices) == 1
    assert whole.usage.completion_tokens == 10 or whole.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # default max_tokens is OpenAI's 16 for this endpoint
    default = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert default.usage.completion_tokens <= 16


def test_completions_batch_of_prompts_with_n(live_server):
    client = live_server.client()
    prompts = ["Question: what is the capital of France?", "Prefix caching shares the KV cache."]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, single in enumerate(singles):
        assert [c.text for c in batch.choices[2 * i : 2 * i + 2]] == [single.choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    # token-id prompts are accepted as well
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5


def test_stop_strings_cut_the_text_streaming_or_not(live_server):
    client = live_server.client()
    prompt = "Stop strings: the quick brown fox jumps over the lazy dog."
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    assert len(free) >= 10, free
    stop = free[6:10]
    expected = free[: free.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-seen"])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat too
    chat_free = chat(client, prompt, max_tokens=24).choices[0].message.content
    chat_stop = chat_free[4:7]
    chat_cut = chat(client, prompt, max_tokens=24, stop=chat_stop)
    assert chat_cut.choices[0].message.content == chat_free[: chat_free.find(chat_stop)]
    streamed = chat(client, prompt, max_tokens=24, stop=chat_stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_free[: chat_free.find(chat_stop)]


def test_benchmark_clients_token_controls_are_honoured_on_both_endpoints(live_server):
    # What vLLM's and SGLang's benchmark clients, AIPerf and guidellm send: ignore_eos must give
    # every token asked for, or their figures for radixkv are wrong.
    client = live_server.client()
    tokenizer_eos = live_server.engine_call(lambda engine: engine.tokenizer.eos_token_id)
    prompt = "Benchmark clients: the quick brown fox jumps over the lazy dog."
    ends = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias={str(tokenizer_eos): 100})
    assert ends.usage.completion_tokens == 1 and ends.choices[0].finish_reason == "stop"
    through = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias={str(tokenizer_eos): 100},
                                        extra_body={"ignore_eos": True})  # fmt: skip
    assert through.usage.completion_tokens == 12 and through.choices[0].finish_reason == "length"
    floor = chat(client, prompt, max_tokens=12, logit_bias={str(tokenizer_eos): 100}, extra_body={"min_tokens": 5})
    assert floor.usage.completion_tokens == 6 and floor.choices[0].finish_reason == "stop"
    streamed = chat(client, prompt, max_tokens=9, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert [c.usage.completion_tokens for c in streamed if c.usage] == [9]


def test_n_choices_and_seeds_are_reproducible(live_server):
    client = live_server.client()
    prompt = "Seeds: the quick brown fox jumps over the lazy dog."
    kwargs = dict(max_tokens=12, temperature=1.5, seed=1234)
    first = client.completions.create(model=MODEL, prompt=prompt, **kwargs)
    again = client.completions.create(model=MODEL, prompt=prompt, **kwargs)
    other = client.completions.create(model=MODEL, prompt=prompt, **{**kwargs, "seed": 99})
    assert first.choices[0].text == again.choices[0].text
    assert other.choices[0].text != first.choices[0].text
    many = chat(client, prompt, n=3, **kwargs)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert len({c.message.content for c in many.choices}) > 1
    assert 3 <= many.usage.completion_tokens <= 3 * 12  # summed over the choices
    repeat = chat(client, prompt, n=3, **kwargs)
    assert [c.message.content for c in repeat.choices] == [c.message.content for c in many.choices]
    streamed = chat(client, prompt, n=3, stream=True, **kwargs)
    texts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in many.choices]


def test_multi_turn_conversation_hits_more_cache_each_turn(live_server):
    client = live_server.client()
    messages = [{"role": "system", "content": "Multi-turn test. " + SYSTEM}]
    hits, prompt_tokens = [], []
    for question in ["What is a prefix cache?", "And a radix tree?", "Why share KV pages?", "Thanks, bye."]:
        messages.append({"role": "user", "content": question})
        # its own salt: other tests on this shared server cache the chat template's first block
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"cache_salt": "multi-turn"}
        )
        hits.append(cached(response))
        prompt_tokens.append(response.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
    assert hits[0] == 0
    assert all(later > earlier for earlier, later in zip(hits, hits[1:])), hits
    # each turn reuses at least the full blocks of the previous turn's prompt but its tail
    assert all(hit >= prev - 8 for hit, prev in zip(hits[1:], prompt_tokens)), (hits, prompt_tokens)
    assert all(hit < total for hit, total in zip(hits, prompt_tokens))


def test_tenants_never_share_cached_prefixes(live_server):
    a, b = live_server.client(KEY_A), live_server.client(KEY_B)
    prompt = "Tenant isolation: " + SYSTEM
    first = chat(a, prompt, max_tokens=2)
    second = chat(a, prompt, max_tokens=2)
    assert cached(second) > cached(first) and cached(second) >= second.usage.prompt_tokens - 4  # its own cache
    assert cached(chat(b, prompt, max_tokens=2)) == 0  # another key: not even the chat template's first block
    assert cached(chat(b, prompt, max_tokens=2)) > 0
    # a request's cache_salt partitions further within one tenant
    assert cached(chat(a, prompt, max_tokens=2, extra_body={"cache_salt": "team-1"})) == 0
    assert cached(chat(a, prompt, max_tokens=2, extra_body={"cache_salt": "team-1"})) > 0
    assert cached(chat(a, prompt, max_tokens=2, extra_body={"cache_salt": "team-2"})) == 0
    # the user field is accepted (and does not partition)
    assert cached(chat(a, prompt, max_tokens=2, user="alice")) > 0


def test_metrics_count_requests_tokens_cache_and_pages(live_server):
    before = metric_values(live_server)
    prompt = "Metrics test: " + SYSTEM
    first = chat(live_server.client(), prompt, max_tokens=5)
    second = chat(live_server.client(), prompt, max_tokens=5)
    after = metric_values(live_server)

    def grew(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    ok = (("endpoint", "/v1/chat/completions"), ("status", "200"))
    assert grew("radixkv_requests_total", ok) == 2
    assert grew("radixkv_generation_tokens_total") == first.usage.completion_tokens + second.usage.completion_tokens
    assert grew("radixkv_prompt_tokens_total") == 2 * first.usage.prompt_tokens
    assert grew("radixkv_cached_prompt_tokens_total") == cached(first) + cached(second)
    assert cached(second) > cached(first)
    assert grew("radixkv_prefix_cache_queries_total") >= 2
    assert grew("radixkv_prefix_cache_hit_tokens_total") >= cached(second)
    assert grew("radixkv_time_to_first_token_seconds_count") == 2
    assert grew("radixkv_time_per_output_token_seconds_count") >= 1
    for gauge in ("radixkv_kv_pages_free", "radixkv_kv_pages_cached", "radixkv_kv_pages_in_use", "radixkv_num_requests_waiting"):
        assert (gauge, ()) in after
    assert after[("radixkv_kv_pages_total", ())] == 512
    assert after[("radixkv_kv_pages_cached", ())] > 0
    live_server.assert_idle_and_consistent()


@pytest.fixture(autouse=True, scope="module")
def _pages_consistent_at_the_end(live_server):
    yield
    live_server.assert_idle_and_consistent()
