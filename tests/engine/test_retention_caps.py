"""Engine retention caps: over all owners together at most max_retained_pages_fraction of the
pool is retained (past it new retentions are trimmed, never another owner's released), and the
knob is validated like the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import ConfigError
from tests.helpers.engine import assert_pages_returned, run_to_end

PAGE_SIZE = 4


def test_many_owners_retain_at_most_the_global_share_of_the_pool(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(
        model=str(tiny_llama), dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64,
        max_retained_pages_per_owner=8, max_retained_pages_fraction=0.25, check_invariants=True,
    ))
    prompts = [[1 + (7 * i + j) % 300 for j in range(6 * PAGE_SIZE)] for i in range(5)]  # 6 pages each
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=1))
    run_to_end(engine)
    retained = [engine.retain(prompt, None, 300.0, owner=f"key{i}") for i, prompt in enumerate(prompts)]
    # 64 pages * 0.25 = 16: two whole prefixes, the third trimmed to the 4 pages left, then none.
    assert retained == [6 * PAGE_SIZE, 6 * PAGE_SIZE, 4 * PAGE_SIZE, 0, 0]
    assert engine.tree.retained_pages == 16
    assert [r.num_pages for r in engine.tree.retentions("key0")] == [6]
    assert [r.num_pages for r in engine.tree.retentions("key1")] == [6]
    assert_pages_returned(engine)


@pytest.mark.parametrize("fraction", [0, 0.0, -0.5, 1.5, True, "half", float("nan")])
def test_the_global_share_is_validated(tiny_llama: Path, fraction: object) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(model=str(tiny_llama), max_retained_pages_fraction=fraction)
    assert info.value.param == "max_retained_pages_fraction"
