"""Tenant isolation and hash collisions.

Two API keys sending the same prompts at the same time are never served a page the other
cached: checked through `cached_tokens`, through every admission (each matched page was put
in the tree under the requester's own salt), and by walking the tree's per-salt roots. With
an injected colliding hash function the outputs stay exactly transformers' greedy ones."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import xxhash

from radixkv import SamplingParams

from tests.helpers.engine import VOCAB, assert_pages_returned, hf_greedy, make_engine, run_to_end
from tests.helpers.live_server import KEY_A, KEY_B, MODEL

# No two share a first block, so a tenant's concurrent first requests cannot hit each other.
PROMPTS = [
    f"{word} and prefix caching: the KV cache of prompts with a common prefix is shared. Why?"
    for word in ("Apples", "Zebras", "Quantum", "Violins", "Harbors", "Mountains")
]


def complete(live, key: str, prompt: str, stream: bool, cache_salt: str | None = None) -> int:
    """One greedy completion; its cached_tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    with live.http(key, timeout_s=60) as client:
        if not stream:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        body.update(stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        return json.loads(lines[-1][len("data: ") :])["usage"]["prompt_tokens_details"]["cached_tokens"]


class AdmissionAudit:
    """Installed on the engine thread: who put each cached page in the tree (its salt), and
    every admission's matched pages, so a page served across salts cannot go unnoticed."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.owner: dict[int, str | None] = {}
        self.admissions: list[tuple[str | None, list[int]]] = []
        self.violations: list[tuple[str | None, int, str | None]] = []
        self._insert, self._admit = engine.tree.insert, engine.kv.admit
        # Pages cached before the audit started: their salt is the root they sit under.
        for salt, root in engine.tree._roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self.owner.update(dict.fromkeys(node.pages, salt))
                stack.extend(node.children.values())
        engine.tree.insert = self.insert
        engine.kv.admit = self.admit

    def insert(self, token_ids, pages, salt=None, **kwargs):
        result = self._insert(token_ids, pages, salt, **kwargs)
        for page in result.pages[result.num_existing_blocks :]:
            self.owner[page] = salt
        return result

    def admit(self, seq, *args, **kwargs):
        cached = self._admit(seq, *args, **kwargs)
        matched = seq.page_table[: seq.num_tree_blocks]
        self.admissions.append((seq.salt, matched))
        for page in matched:
            if self.owner.get(page, "<never cached>") != seq.salt:
                self.violations.append((seq.salt, page, self.owner.get(page, "<never cached>")))
        return cached

    def remove(self, _engine=None) -> None:
        del self.engine.tree.insert, self.engine.kv.admit  # back to the class methods


def pages_by_salt(engine) -> dict[str | None, set[int]]:
    result = {}
    for salt, root in engine.tree._roots.items():
        pages, stack = set(), list(root.children.values())
        while stack:
            node = stack.pop()
            assert node.salt == salt
            pages.update(node.pages)
            stack.extend(node.children.values())
        result[salt] = pages
    return result


def test_two_keys_at_once_never_share_a_page(live):
    audit = live.engine_call(AdmissionAudit)
    try:
        # A caches every prompt first; then A and B send them all at once, twice over.
        assert all(complete(live, KEY_A, p, stream=False) == 0 for p in PROMPTS)
        jobs = [(key, p, i % 2 == 0) for i, p in enumerate(PROMPTS) for key in (KEY_A, KEY_B)]
        with ThreadPoolExecutor(8) as pool:
            first_wave = list(pool.map(lambda job: complete(live, *job), jobs))
            second_wave = list(pool.map(lambda job: complete(live, *job), jobs))
            salted = list(pool.map(lambda p: complete(live, KEY_A, p, False, "team-1"), PROMPTS))
    finally:
        live.engine_call(audit.remove)
    for (key, prompt, _), first, second in zip(jobs, first_wave, second_wave):
        if key == KEY_A:
            assert first > 0 and second > 0, prompt  # its own cache
        else:
            assert first == 0, prompt  # B's prompts share no block with each other: nothing of A's
            assert second > 0, prompt  # but B's own first wave is cached for B
    assert salted == [0] * len(PROMPTS)  # a cache_salt is a partition of its own within a key
    assert not audit.violations, audit.violations[:5]
    salts = {live.salt_of(KEY_A), live.salt_of(KEY_B), live.salt_of(KEY_A, "team-1")}
    hits = {salt: sum(1 for s, pages in audit.admissions if s == salt and pages) for salt in salts}
    assert all(hits[salt] > 0 for salt in salts - {live.salt_of(KEY_A, "team-1")}), hits

    live.assert_idle_and_consistent()
    by_salt = live.engine_call(pages_by_salt)
    assert salts <= set(by_salt)
    for a in by_salt:
        for b in by_salt:
            if a != b:
                assert not by_salt[a] & by_salt[b], (a, b, sorted(by_salt[a] & by_salt[b])[:8])
    # Every block under a salt's root hashes (with that salt) to what the tree stores.
    live.engine_call(lambda engine: engine.tree.check_invariants(check_hashes=True))


# -- hash collisions -------------------------------------------------------------------------


def collide_all(data: bytes) -> int:
    return 0


def collide_often(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data) & 1  # two hash values in all


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (29, 18)]
    prompts = [systems[i % 2] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))] for i in range(8)]
    prompts += [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    return prompts


MAX_NEW = 10


@pytest.fixture(scope="module")
def collision_reference(tiny_llama):
    prompts = workload(7)
    return prompts, hf_greedy(tiny_llama, prompts, MAX_NEW)


@pytest.mark.parametrize("hash_fn", [collide_all, collide_often])
@pytest.mark.parametrize("num_pages", [256, 20], ids=["ample", "small-pool"])
def test_colliding_hashes_keep_outputs_exact(tiny_loaded, collision_reference, hash_fn, num_pages):
    prompts, expected = collision_reference
    engine = make_engine(tiny_loaded, num_pages=num_pages)
    engine.hasher.hash_fn = hash_fn  # the tree and the KV manager share this hasher
    params = SamplingParams(max_tokens=MAX_NEW)
    for salt in (None, "tenant-b", None):  # cold, another tenant, then warm
        ids = [engine.add_request(p, params, salt=salt) for p in prompts]
        finals = run_to_end(engine)
        assert [finals[i].token_ids for i in ids] == expected, (hash_fn.__name__, salt)
    assert_pages_returned(engine)  # includes recomputing every stored hash with hash_fn
    if num_pages == 256:
        assert engine.stats().cache.hit_tokens > 0  # equal prefixes still hit
    by_salt = pages_by_salt(engine)
    assert not by_salt.get(None, set()) & by_salt.get("tenant-b", set())


def test_the_collision_hook_is_the_one_in_use(tiny_loaded):
    """Guards the two tests above: the injected function really hashes the blocks."""
    engine = make_engine(tiny_loaded)
    engine.hasher.hash_fn = collide_all
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=2))
    run_to_end(engine)
    stored = [h for root in engine.tree._roots.values() for child in root.children.values() for h in child.hashes]
    assert stored and set(stored) == {0}
