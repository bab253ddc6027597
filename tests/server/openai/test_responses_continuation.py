"""A stored turn's ids for previous_response_id: kept with its conversation within the byte
caps (4 bytes a token), left out when they would go over, and only ever read by their owner.
The live path is in tests/server/test_continuation.py (over the default model)."""

from __future__ import annotations

from array import array

from radixkv.server.openai.responses_store import TOKEN_BYTES, ResponseStore, TurnIds, conversation_bytes

MESSAGES = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}]


def turn(num_tokens: int) -> TurnIds:
    return TurnIds(array("i", range(num_tokens)), 3, "context")


def test_ids_are_kept_and_counted_in_bytes():
    store = ResponseStore()
    assert store.put("resp_1", "a", MESSAGES, turn(100))
    assert store.ids_of("resp_1", "a").token_ids.tolist() == list(range(100))
    assert store.held_by("a") == (1, conversation_bytes(MESSAGES) + 100 * TOKEN_BYTES)
    assert store.ids_of("resp_1", "b") is None and store.get("resp_1", "b") is None


def test_ids_over_the_byte_cap_are_left_out_not_the_conversation():
    cap = conversation_bytes(MESSAGES) + 10 * TOKEN_BYTES + 1024
    store = ResponseStore(max_bytes_per_owner=cap)
    assert store.put("resp_1", "a", MESSAGES, turn(1024 // TOKEN_BYTES + 20))  # the ids alone overflow it
    assert store.get("resp_1", "a") == MESSAGES and store.ids_of("resp_1", "a") is None
    assert store.held_by("a") == (1, conversation_bytes(MESSAGES))
    assert store.put("resp_2", "a", MESSAGES, turn(10))
    assert store.ids_of("resp_2", "a") is not None


def test_ids_count_against_the_owners_cap_not_anothers():
    per_owner = 2 * (conversation_bytes(MESSAGES) + 50 * TOKEN_BYTES)
    store = ResponseStore(max_bytes_per_owner=per_owner, max_bytes=4 * per_owner)
    store.put("a1", "a", MESSAGES, turn(50))
    for k in range(20):  # b stores over and over, ids and all
        store.put(f"b{k}", "b", MESSAGES, turn(50))
    assert store.ids_of("a1", "a") is not None
    assert store.held_by("b")[1] <= per_owner
