"""The seam every backend's per-step state meets (radixkv/attention/base.py, StepState): the
engine reads its KV reads, the fused CPU decode asks it for checked tables; nothing else of a
state is read outside its backend."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.paged import make_meta, make_paged

from radixkv.attention import backend_class
from radixkv.attention.base import DecodeTables, KVReads
from radixkv.cpu import native

BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(native.load() is None, reason="the CPU backend needs the native library")),
    "triton",  # under TRITON_INTERPRET=1 off a GPU (tests/conftest.py)
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("decode_only", [True, False])
def test_every_backend_state_meets_step_state(name, decode_only):
    gen = torch.Generator().manual_seed(0)
    # Three requests over one 2-page prefix, so a decode step may group them.
    paged = make_paged(gen, [40, 41, 42], num_kv_heads=1, head_dim=16, page_size=16, dtype=torch.float32)
    paged.page_table[1:, :2] = paged.page_table[0, :2]
    q_lens = [1, 1, 1] if decode_only else [1, 5, 1]
    meta = make_meta(paged, [s - n for s, n in zip([40, 41, 42], q_lens, strict=True)], q_lens)
    backend = backend_class(name)()
    state = backend.begin_step(meta, paged.k_cache, 2).state
    assert state is meta.backend_state
    reads, tables = state.kv_reads, state.decode_tables()
    assert reads is None or isinstance(reads, KVReads)
    if name == "cpu" and decode_only:  # the one backend whose decode a fused native step may replace
        assert isinstance(tables, DecodeTables)
        assert torch.equal(tables.page_table, paged.page_table) and torch.equal(tables.seq_lens, paged.seq_lens)
        assert tables.slot_mapping.dtype == torch.int64 and torch.equal(tables.slot_mapping, meta.slot_mapping)
    else:
        assert tables is None
    if name != "torch" and decode_only:  # the CPU and Triton backends count their decode reads
        assert reads is not None and reads.tokens == 40 + 41 + 42
    if name == "torch" or not decode_only:
        assert reads is None


def test_the_state_is_asked_for_only_after_begin_step():
    gen = torch.Generator().manual_seed(0)
    meta = make_meta(make_paged(gen, [3], 1, 16, 16, torch.float32), [2], [1])
    with pytest.raises(AssertionError, match="begin_step"):
        meta.state  # noqa: B018
