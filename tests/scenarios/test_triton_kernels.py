"""scenarios/triton_kernels.py's measuring code, run at tiny sizes on the interpreter (fp32, one call
per timing), so the one GPU run a session may get does not fail on the bench itself."""

from __future__ import annotations

import pytest
import torch

from radixkv.scenarios import triton_kernels as bench

CEILINGS = {"copy_gbps": 100.0, "matmul_tflops": 1.0}


@pytest.fixture
def cpu_bench(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the bench itself runs: python -m radixkv.scenarios.triton_kernels")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "_bench_ms", lambda fn: (fn(), 1.0)[1])
    return bench


def test_decode_and_extend_agree_with_sdpa(cpu_bench):
    decode = cpu_bench.bench_decode(bench.DecodeShape(3, 40, 4, 2, 16), CEILINGS)
    assert decode["max_rel_err_vs_sdpa"] < 1e-5 and decode["triton_gbps"] > 0
    for prefix in (0, 21):
        extend = cpu_bench.bench_extend(bench.ExtendShape(2, prefix, 9, 4, 2, 16), CEILINGS)
        assert extend["max_rel_err_vs_sdpa"] < 1e-5 and extend["triton_tflops"] > 0


def test_cascade_decode_agrees_with_decoding_apart_and_reads_less(cpu_bench):
    shape = bench.CascadeShape(num_seqs=6, num_groups=2, shared=48, own=7, num_q_heads=4, num_kv_heads=2, head_dim=16)
    result = cpu_bench.bench_cascade(shape, CEILINGS)
    assert result["max_rel_err_cascade_vs_apart"] < 1e-5
    # Each group's 48 shared tokens read once instead of by each of its 3 members.
    assert result["bytes_ratio"] == pytest.approx(6 * 55 / (2 * 48 + 6 * 7))


def test_store_kv_is_timed(cpu_bench):
    assert cpu_bench.bench_store(20, 2, 16, CEILINGS)["triton_gbps"] > 0
