"""The exact-continuation doors through the real app over a tiny model: echoed replies with a
forged splice marker cost two renders and at most max_spliced_replies lookups (chat, Messages,
/v1/cache/lookup), a prompt past the context is refused with no splice work, breakpoints cost no
rendering of their own, and a reply splices only in the cache partition it was made in. Work is counted (renders, lookups), never timed.
Replies are written into the map as ids their text does not re-tokenize to, so no case depends
on what a model samples on this CPU."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from radixkv.prompts.continuation import decode_exact
from radixkv.engine.request_output import CompletionOutput, RequestOutput
from radixkv.prompts import tools as tool_layer
from radixkv.prompts.replies import ReplyMap
from radixkv.server.continuation import ReplyCollector
from radixkv.server.encode import chat_conversation, chat_prompt
from radixkv.server.openai import prompt_cache
from radixkv.server.openai.protocol import ChatCompletionRequest
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer, make_async_engine, serve
from tests.helpers.tiny_models import make_tiny_model

CONTEXT = 8192  # the fixture's positions, and its pages' tokens (2048 pages of 4)
NUM_REPLIES = 100
# Today's marker format for the first replies' indices (1, 3, 5: each after its question), and
# the shape of a nonce marker: text a client can send. One forged marker used to fail the joint
# splice and retry each reply alone.
FORGED = "".join(f"\ue000radixkv-reply-{i}\ue001 \ue000radixkv-{'0' * 32}-{i}\ue001 " for i in (1, 3, 5))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-8k"), "llama", max_position_embeddings=CONTEXT)
    with serve(make_async_engine(model, num_pages=CONTEXT // 4)) as server:
        yield server


@dataclass
class Work:
    renders: int = 0  # chat template renderings of a conversation
    lookups: int = 0  # ReplyMap.get calls


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Work:
    counted = Work()
    render, get = tool_layer.render_conversation, ReplyMap.get

    def counting_render(*args: Any, **kwargs: Any) -> str:
        counted.renders += 1
        return render(*args, **kwargs)

    def counting_get(self: ReplyMap, *args: Any, **kwargs: Any) -> list[int] | None:
        counted.lookups += 1
        return get(self, *args, **kwargs)

    monkeypatch.setattr(tool_layer, "render_conversation", counting_render)
    monkeypatch.setattr(ReplyMap, "get", counting_get)
    return counted


def state(live: LiveServer) -> Any:
    return live.app.state.radixkv


def owner(live: LiveServer, key: str) -> str:
    return state(live).tenants.owner(key.encode())


def by_characters(tokenizer: Any, text: str) -> list[int]:
    """Ids decoding to `text`, one piece per character: not what its text re-tokenizes to."""
    ids = [i for ch in text for i in tokenizer(ch, add_special_tokens=False).input_ids]
    assert decode_exact(tokenizer, ids) == text and ids != tokenizer(text, add_special_tokens=False).input_ids
    return ids


def remember_replies(live: LiveServer, key: str, cache_salt: str | None, texts: list[str]) -> None:
    """The replies as if `key` had generated them in that partition (by_characters ids)."""
    replies, tokenizer = state(live).replies, state(live).engine.tokenizer
    salt = live.salt_of(key, cache_salt)
    for text in texts:
        assert replies.remember(owner(live, key), text, by_characters(tokenizer, text), salt=salt)


def echoed(texts: list[str], last: str) -> list[dict[str, str]]:
    """A conversation sending every reply back, then a user message `last`."""
    messages = []
    for k, text in enumerate(texts):
        messages += [{"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": text}]
    return messages + [{"role": "user", "content": last}]


def replies_of(tag: str) -> list[str]:
    return [f"The quick brown fox {tag} {k}." for k in range(NUM_REPLIES)]


def post(live: LiveServer, door: str, messages: list[dict[str, str]], key: str = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if door == "chat":
        return httpx.post(f"{live.base_url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1},
                          headers=headers, timeout=120)  # fmt: skip
    if door == "messages":
        return httpx.post(f"{live.base_url}/v1/messages", json={"model": MODEL, "messages": messages, "max_tokens": 1},
                          headers={**headers, "anthropic-version": "2023-06-01"}, timeout=120)  # fmt: skip
    return httpx.post(f"{live.base_url}/v1/cache/lookup", json={"messages": messages}, headers=headers, timeout=120)


@pytest.mark.parametrize("door", ["chat", "messages"])
def test_a_prompt_past_the_context_is_refused_before_any_splice_work(live, work, door):
    texts = replies_of(f"past-{door}")
    remember_replies(live, KEY_A, None, texts)  # chat without cache_salt and Messages share it
    messages = echoed(texts, FORGED + "zqv jxk " * 800)
    assert len(chat_prompt(state(live), messages)) >= CONTEXT  # the case: the plain prompt is past it
    work.renders = work.lookups = 0
    response = post(live, door, messages)
    assert response.status_code == 400 and "context" in response.text
    # One rendering and tokenization, of the plain prompt; no reply looked up or spliced.
    assert (work.renders, work.lookups) == (1, 0)


@pytest.mark.parametrize("door", ["lookup", "chat"])
def test_echoed_replies_with_a_forged_marker_cost_two_renders_and_at_most_the_cap(live, work, door):
    texts = replies_of(f"echo-{door}")
    remember_replies(live, KEY_A, None, texts)
    messages = echoed(texts, FORGED + "Thanks.")
    generation = door != "lookup"
    work.renders = work.lookups = 0
    response = post(live, door, messages)
    assert response.status_code == 200, response.text
    assert work.renders == 2  # plain, then marked: not one more per reply
    assert work.lookups == state(live).limits.max_spliced_replies == 64  # the earliest 64 of 100
    spliced = chat_prompt(state(live), messages, add_generation_prompt=generation, owner=owner(live, KEY_A), salt=live.salt_of(KEY_A))
    plain = chat_prompt(state(live), messages, add_generation_prompt=generation)
    assert spliced != plain  # the forged markers did not stop the splice
    body = response.json()
    assert (body["usage"]["prompt_tokens"] if generation else body["prompt_tokens"]) == len(spliced)


def test_a_reply_splices_only_in_the_partition_it_was_made_in(live):
    reply = "The quick brown fox in partition x."
    remember_replies(live, KEY_A, "x", [reply])
    messages = echoed([reply], "Again.")
    server, me = state(live), owner(live, KEY_A)
    plain = chat_prompt(server, messages)
    assert chat_prompt(server, messages, owner=me, salt=live.salt_of(KEY_A, "x")) != plain
    for other in ("y", None):  # another cache_salt, and the key's default partition (Messages')
        assert chat_prompt(server, messages, owner=me, salt=live.salt_of(KEY_A, other)) == plain
    assert chat_prompt(server, messages, owner=owner(live, KEY_B), salt=live.salt_of(KEY_B, "x")) == plain

    def prompt_tokens(cache_salt: str) -> int:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "cache_salt": cache_salt}
        response = live.http().post("/v1/chat/completions", json=body)
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("y") == len(plain)
    assert prompt_tokens("x") != len(plain)


def test_a_finished_reply_is_remembered_in_its_requests_partition(live):
    tokenizer = state(live).engine.tokenizer
    replies = ReplyMap(tokenizer, 10, 1000, 1000)
    text = "The quick brown fox remembered."
    ids = by_characters(tokenizer, text)
    output = CompletionOutput(index=0, text=text, token_ids=ids, finish_reason="stop")
    final = RequestOutput("r", [1], [output], num_prompt_tokens=1, num_cached_tokens=0, time_to_first_token_s=None, total_time_s=None)
    ReplyCollector(replies, "a", "salt-x").finished(final)
    assert replies.get("a", text, salt="salt-x") == ids
    assert replies.get("a", text, salt="salt-y") is None and replies.get("a", text) is None


def test_an_owners_caps_hold_over_all_its_partitions(live):
    tokenizer = state(live).engine.tokenizer
    replies = ReplyMap(tokenizer, max_entries_per_owner=2, max_tokens_per_owner=1000, max_tokens=1000)
    text = "The quick brown fox."
    for salt in ("p", "q", "r"):  # a fresh cache_salt buys no fresh room
        assert replies.remember("a", text, by_characters(tokenizer, text), salt=salt)
    assert replies.held_by("a")[0] == 2
    assert replies.get("a", text, salt="p") is None and replies.get("a", text, salt="r") is not None


@pytest.mark.parametrize("door", ["chat", "responses", "messages"])
def test_a_cache_report_reads_the_one_rendering_the_prompt_came_from(live, work, door):
    """Every route hands its encoder's EncodedConversation to the cache reporter: the prompt's
    one rendering, and one without the generation prompt to align its parts; none of its own."""
    messages = [{"role": "user", "content": f"Report {door}: where does it miss?"}]
    headers = {"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"}
    path, body = {
        "chat": ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
        "responses": ("/v1/responses", {"input": messages, "max_output_tokens": 1, "store": False}),
        "messages": ("/v1/messages", {"messages": messages, "max_tokens": 1}),
    }[door]
    work.renders = 0
    response = httpx.post(f"{live.base_url}{path}", json={"model": MODEL, "cache_report": True, **body}, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["cache_report"]["part"] is not None
    assert work.renders == 2


def marked_body(door: str, messages: list[dict[str, str]], every: int) -> tuple[str, dict[str, Any]]:
    """The door's body for `messages`, every `every`th user message's text a marked part: a
    prompt_cache_breakpoint (chat, Responses) or a cache_control block (Messages)."""
    mark = {"cache_control": {"type": "ephemeral"}} if door == "messages" else {"prompt_cache_breakpoint": {"mode": "explicit"}}
    kind = "input_text" if door == "responses" else "text"
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    marked = [
        {**m, "content": [{"type": kind, "text": m["content"], **mark}]} if i in users[every - 1 :: every][:4] else m
        for i, m in enumerate(messages)
    ]
    if door == "chat":
        return "/v1/chat/completions", {"messages": marked, "max_tokens": 1}
    if door == "responses":
        return "/v1/responses", {"input": marked, "max_output_tokens": 1, "store": False}
    return "/v1/messages", {"messages": marked, "max_tokens": 1}


@pytest.mark.parametrize("spliced", [False, True])
@pytest.mark.parametrize("door", ["chat", "responses", "messages"])
def test_breakpoints_are_read_off_the_prompts_one_rendering(live, work, door, spliced):
    """Four breakpoints cost no rendering of their own: the prompt's, one without the
    generation prompt to align its parts, and with known replies the splice's marked one."""
    texts = replies_of(f"marks-{door}-{spliced}")[:8]
    if spliced:
        remember_replies(live, KEY_A, None, texts)
    path, body = marked_body(door, echoed(texts, "Thanks."), every=2)
    headers = {"Authorization": f"Bearer {KEY_A}", "anthropic-version": "2023-06-01"}
    work.renders = 0
    response = httpx.post(f"{live.base_url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    assert work.renders == (3 if spliced and door != "responses" else 2)  # Responses splices nothing


def test_a_spliced_prompts_breakpoints_equal_rendering_each_cut(live):
    """Read off the one rendering or rendered cut by cut, a spliced chat prompt's breakpoints
    are the same keeps (each no further than the splice agrees with the plain prompt)."""
    texts = replies_of("marks-equal")[:8]
    remember_replies(live, KEY_A, None, texts)
    _, raw = marked_body("chat", echoed(texts, "Thanks."), every=1)
    body = ChatCompletionRequest.model_validate(raw)
    server, messages = state(live), [m.as_chat() for m in body.messages]
    encoded = chat_conversation(server, messages, [], "none", owner=owner(live, KEY_A), salt=live.salt_of(KEY_A))
    assert encoded.spliced
    read = prompt_cache.chat_writes(server, body, [], "none", encoded.token_ids, encoded)
    assert len(read) == 4 and read == prompt_cache.chat_writes(server, body, [], "none", encoded.token_ids)
