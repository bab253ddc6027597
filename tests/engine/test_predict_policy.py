"""EngineConfig.eviction_policy="predict": finished requests teach the online dead-block
predictor (cache/dead_blocks.py), whose marks the eviction order follows."""

from __future__ import annotations

from pathlib import Path

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.request import SamplingParams
from radixkv.engine.sessions import SessionRef
from tests.helpers.engine import assert_pages_returned, run_to_end

PAGE_SIZE = 4


def prompt(seed: int, pages: int) -> list[int]:
    return [1 + (7 * seed + 13 * j) % 300 for j in range(pages * PAGE_SIZE)]


def test_the_engine_feeds_the_predictor_turn_by_turn(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64, seed=0, eviction_policy="predict")
    engine = Engine(config)
    assert engine.predicted is not None and engine.tree.eviction_policy == "predict"
    duel = engine.predicted.predictor.duel  # guarded by a duel against a shadow LRU the pool's size
    assert duel is not None and duel.lru.capacity == config.num_pages
    history = prompt(1, 3)
    for number in range(3):
        request_id = engine.add_request(history, SamplingParams(max_tokens=4, ignore_eos=True), session=SessionRef("alice", "s1") if number else None)
        output = run_to_end(engine)[request_id]
        history = list(output.prompt_token_ids) + output.outputs[0].token_ids + prompt(10 + number, 1)
    predictor = engine.predicted.predictor
    assert predictor.num_requests == 3 and predictor.num_extended == 2
    engine.tree.check_invariants()
    assert_pages_returned(engine)


def test_other_policies_run_no_predictor(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64, seed=0))
    assert engine.predicted is None


def test_a_released_session_tells_the_predictor_its_tail_is_dead(tiny_llama: Path) -> None:
    # DELETE /v1/cache/sessions/{key} reaches engine.sessions.release; the engine wires it to the predictor.
    config = EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64, seed=0, eviction_policy="predict")
    engine = Engine(config)
    assert engine.predicted is not None
    ref = SessionRef("alice", "s1")
    history = prompt(2, 3)
    for number in range(2):
        request_id = engine.add_request(history, SamplingParams(max_tokens=4, ignore_eos=True), session=ref)
        output = run_to_end(engine)[request_id]
        history = list(output.prompt_token_ids) + output.outputs[0].token_ids + prompt(20 + number, 1)
    predictor = engine.predicted.predictor
    assert predictor.num_released == 0
    assert not engine.sessions.release("mallory", "s1")  # another owner's name: nothing released
    assert predictor.num_released == 0
    assert engine.sessions.release("alice", "s1")
    assert predictor.num_released == 1
    assert not engine.predicted.released(ref)  # already told
    engine.tree.check_invariants()
    assert_pages_returned(engine)
