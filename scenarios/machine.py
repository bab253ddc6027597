"""This machine's own limits, measured in the run that reports against them: the CPU (model and
flags), the streaming read bandwidth, and the matmul rate in the dtype the run computes in.

Every speed figure a scenario prints is set beside these, so a number from one machine can be
read on another (shared VMs move from run to run: compare ratios from one run only).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from radixkv.cpu.features import cpu_features


def cpu_model() -> str:
    """The CPU's model name, and the flags that decide radixkv's CPU paths."""
    features = cpu_features()
    shown = [flag for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "bf16") if flag in features.flags]
    return f"{features.model_name or features.machine} ({', '.join(shown) or 'no AVX-512/AMX/bf16'})"


def read_bandwidth_bytes_per_s(size_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes read per second by the fastest of a few streaming reductions over a 1 GiB tensor.

    The fastest, not an average: the ideal a step is held to should be the machine's read
    ceiling, so the ratio errs against us.
    """
    as_bytes = torch.ones(size_bytes, dtype=torch.int8)
    as_floats = as_bytes.view(torch.float32)
    best = float("inf")
    for reduce in (lambda: as_bytes.max(), lambda: as_floats.sum()):
        reduce()
        for _ in range(repeats):
            start = time.perf_counter()
            reduce()
            best = min(best, time.perf_counter() - start)
    return size_bytes / best


def copy_bandwidth_bytes_per_s(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read + written per second by a large tensor copy."""
    src = torch.empty(size_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * size_bytes / best


def matmul_flops_per_s(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """Multiply-adds per second (x2) of the fastest of a few square matmuls in dtype, through
    torch (oneDNN/MKL): the rate compute-bound work is held to."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def machine_limits(dtype: torch.dtype) -> dict:
    """The figures every CPU speed report carries, measured now."""
    return dict(
        cpu=cpu_model(),
        torch_threads=torch.get_num_threads(),
        read_bandwidth_gb_s=read_bandwidth_bytes_per_s() / 1e9,
        matmul_gflops=matmul_flops_per_s(dtype) / 1e9,
        matmul_dtype=str(dtype).removeprefix("torch."),
    )


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """A process's resident bytes now and at its peak (Linux /proc: VmRSS, VmHWM; 0 where
    unreadable)."""
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return dict(rss_bytes=found.get("VmRSS", 0), peak_rss_bytes=found.get("VmHWM", 0))
