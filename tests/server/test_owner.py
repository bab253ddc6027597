"""One owner per API key, everywhere: a key that rotates cache_salt keeps one retention cap and
one pin cap, and cannot push another key's retained prefix out; pins are capped per key by a share of the pool,
have unguessable ids and only their key can release them; stored Responses are kept per key, so
one key's flood never evicts another's, and a conversation over the byte cap is refused."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from radixkv.cache.disk_format import digest
from radixkv.server.limits import ServerLimits
from tests.helpers.engine import wait_until
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, LiveServer, make_async_engine, serve
from tests.helpers.tiny_models import make_tiny_model

PAGE_SIZE = 4  # make_async_engine's pages
NUM_PAGES = 1024
OWNER_CAP_PAGES = 64
STORED_PER_KEY = 3
STORED_BYTES_PER_KEY = 2048


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny Llama with 2048 positions (room for a conversation over the byte cap), a small
    retention cap per owner and small Responses store caps; the pin cap per key is the default."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-2k"), "llama", max_position_embeddings=2048)
    engine = make_async_engine(model, num_pages=NUM_PAGES, max_retained_pages_per_owner=OWNER_CAP_PAGES)
    limits = ServerLimits(max_stored_responses_per_key=STORED_PER_KEY, max_stored_response_bytes_per_key=STORED_BYTES_PER_KEY)
    with serve(engine, limits=limits) as server:
        yield server


def tokens(seed: int, num_pages: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(num_pages * PAGE_SIZE)]


def owner_of(live: LiveServer, key: str) -> str:
    return live.app.state.radixkv.tenants.owner(key.encode())


def test_a_key_rotating_cache_salt_has_one_retention_cap_and_evicts_no_other_keys_retention(live: LiveServer) -> None:
    kept = tokens(1, 10) + [7]  # B's retained prefix: 10 full pages
    with live.http(KEY_B) as b:
        done = b.post("/v1/completions", json={"model": MODEL, "prompt": kept, "max_tokens": 1, "prompt_cache_retention": "in_memory"})
        assert done.status_code == 200, done.text
        before = b.post("/v1/cache/lookup", json={"prompt": kept}).json()["ram_tokens"]
    assert before == 10 * PAGE_SIZE
    # A asks to retain more than the whole pool, each request in a fresh cache_salt.
    with live.http(KEY_A) as a:
        for i in range(NUM_PAGES // OWNER_CAP_PAGES + 4):
            body = {
                "model": MODEL, "prompt": tokens(100 + i, OWNER_CAP_PAGES), "max_tokens": 1,
                "cache_salt": f"rotated-{i}", "prompt_cache_retention": "in_memory",
            }
            response = a.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
    owner_a, owner_b = owner_of(live, KEY_A), owner_of(live, KEY_B)

    def retained(engine) -> tuple[int, int, int]:
        tree = engine.tree
        return tree.retained_pages, sum(r.num_pages for r in tree.retentions(owner_a)), sum(r.num_pages for r in tree.retentions(owner_b))

    total, of_a, of_b = live.engine_call(retained)
    assert of_a <= OWNER_CAP_PAGES and of_b == 10
    assert total == of_a + of_b  # nothing retained under any other owner (a salt, say)
    with live.http(KEY_B) as b:
        assert b.post("/v1/cache/lookup", json={"prompt": kept}).json()["ram_tokens"] == before
    live.assert_idle_and_consistent()


def test_a_key_rotating_cache_salt_retains_on_disk_as_one_owner(tiny_llama: Path, tmp_path: Path) -> None:
    """Retention is written through to the disk tier under its owner, whose retained bytes
    there are capped: every salt of one key must be that one owner."""
    with serve(make_async_engine(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))) as server:
        with server.http(KEY_A) as a:
            for i in range(6):
                body = {
                    "model": MODEL, "prompt": tokens(400 + i, 4), "max_tokens": 1,
                    "cache_salt": f"rotated-{i}", "prompt_cache_retention": "24h",
                }
                assert a.post("/v1/completions", json=body).status_code == 200
        expected = {digest(owner_of(server, KEY_A)).hex()}

        def disk_owners(engine) -> set[str]:
            return {retention.owner for _, retention in engine.cache_view.loader.tier.index.retentions()}

        assert wait_until(lambda: server.engine_call(disk_owners) == expected, 10), server.engine_call(disk_owners)


def pin(http, seed: int, num_pages: int):
    return http.post("/v1/cache/pin", json={"prompt": tokens(seed, num_pages)})


def test_pins_are_capped_per_key_by_a_share_of_the_pool(live: LiveServer) -> None:
    per_key = NUM_PAGES // 4  # engine.pins.MAX_PINNED_FRACTION_PER_OWNER of the pool
    with live.http(KEY_A) as a, live.http(KEY_B) as b:
        first = pin(a, 200, 100)
        assert first.status_code == 200, first.text
        over = pin(a, 201, per_key - 100 + 1)
        assert over.status_code == 429 and over.json()["error"]["code"] == "pin_limit_exceeded"
        assert f"at most {per_key}" in over.json()["error"]["message"]
        other = pin(b, 202, per_key - 100 + 1)  # B's own share
        assert other.status_code == 200, other.text
        for http, response in ((a, first), (b, other)):
            assert http.delete(f"/v1/cache/pin/{response.json()['pin_id']}").status_code == 200
    live.assert_idle_and_consistent()


def test_one_key_varying_cache_salt_shares_one_pin_budget(live: LiveServer) -> None:
    """Each cache_salt is its own partition of the cache, never its own owner: the key's pins
    under every salt count against one cap, and its own unpin releases each."""
    per_key = NUM_PAGES // 4
    with live.http(KEY_A) as a:
        made = []
        for i, num_pages in enumerate((100, 100)):
            response = a.post("/v1/cache/pin", json={"prompt": tokens(500 + i, num_pages), "cache_salt": f"rotated-{i}"})
            assert response.status_code == 200, response.text
            made.append(response.json()["pin_id"])
        over = a.post("/v1/cache/pin", json={"prompt": tokens(502, per_key - 200 + 1), "cache_salt": "rotated-2"})
        assert over.status_code == 429 and over.json()["error"]["code"] == "pin_limit_exceeded"
        assert sorted(p["pin_id"] for p in a.get("/v1/cache/pin").json()["data"]) == sorted(made)
        owner = owner_of(live, KEY_A)
        assert {p.owner for p in live.engine_call(lambda engine: engine.pins_of(owner))} == {owner}
        for pin_id in made:
            assert a.delete(f"/v1/cache/pin/{pin_id}").status_code == 200
    live.assert_idle_and_consistent()


def test_pin_ids_are_unguessable_and_only_their_key_unpins(live: LiveServer) -> None:
    with live.http(KEY_A) as a, live.http(KEY_B) as b:
        made = [pin(a, 300 + i, 2) for i in range(3)]
        assert all(response.status_code == 200 for response in made), [r.text for r in made]
        ids = [response.json()["pin_id"] for response in made]
        assert max(ids) > 1 << 32 and sorted(ids) != list(range(min(ids), min(ids) + 3))  # random, not counted
        # B cannot release A's pin, and learns nothing from trying: the same 404 as an unknown id.
        stolen = b.delete(f"/v1/cache/pin/{ids[0]}")
        unknown = b.delete(f"/v1/cache/pin/{ids[0] + 1}")
        assert stolen.status_code == unknown.status_code == 404
        assert stolen.json()["error"]["code"] == unknown.json()["error"]["code"] == "not_found"
        assert b.get("/v1/cache/pin").json()["data"] == []
        assert sorted(p["pin_id"] for p in a.get("/v1/cache/pin").json()["data"]) == sorted(ids)
        assert live.engine_call(lambda engine: engine.tree.locked_pages) == 6  # A's pins still hold
        for pin_id in ids:
            assert a.delete(f"/v1/cache/pin/{pin_id}").status_code == 200
    live.assert_idle_and_consistent()


def respond(client: openai.OpenAI, input: str, **kwargs):
    return client.responses.create(model=MODEL, input=input, max_output_tokens=2, temperature=0, **kwargs)


def test_one_keys_stored_responses_never_evict_anothers(live: LiveServer) -> None:
    a, b = live.client(KEY_A), live.client(KEY_B)
    kept = respond(b, "B's conversation.")
    floods = [respond(a, f"A's flood {i}.") for i in range(STORED_PER_KEY + 3)]
    store = live.app.state.responses_store
    assert store.held_by(owner_of(live, KEY_A))[0] == STORED_PER_KEY  # A's own oldest went
    assert respond(b, "Go on.", previous_response_id=kept.id, store=False).previous_response_id == kept.id
    with pytest.raises(openai.BadRequestError) as error:
        respond(a, "Go on.", previous_response_id=floods[0].id, store=False)
    assert error.value.body["code"] == "previous_response_not_found"
    assert respond(a, "Go on.", previous_response_id=floods[-1].id, store=False).previous_response_id == floods[-1].id
    with pytest.raises(openai.BadRequestError):  # nor can A read B's
        respond(a, "Go on.", previous_response_id=kept.id, store=False)


def test_a_conversation_over_the_byte_cap_is_refused_only_when_stored(live: LiveServer) -> None:
    client = live.client(KEY_A)
    text = "All work and no play. " * 100  # over 2048 bytes, well within the context
    with pytest.raises(openai.BadRequestError) as error:
        respond(client, text)
    body = error.value.body
    assert body["code"] == "stored_response_too_large" and body["param"] == "input"
    assert str(STORED_BYTES_PER_KEY) in body["message"]
    assert respond(client, text, store=False).status in ("completed", "incomplete")
