"""What this CPU offers: its model name and feature flags, read from /proc/cpuinfo once.

The native library's cache key, the `auto` dtype (bf16 only where AMX computes it) and the
tests' skip reasons all read these, so the file is parsed in one place.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CPUFeatures:
    machine: str  # platform.machine(), e.g. "x86_64"
    model_name: str  # "" where /proc/cpuinfo is absent (not Linux)
    flags: frozenset[str]

    @property
    def amx_bf16(self) -> bool:
        """AMX bf16 tiles (Sapphire Rapids and later)."""
        return "amx_bf16" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def signature(self) -> str:
        """Machine, model and flags: a library built with -march=native runs only where these match."""
        return f"{self.machine}|{self.model_name}|{' '.join(sorted(self.flags))}"


# Cached: the CPU does not change under a running process, and /proc/cpuinfo is long.
@functools.cache
def cpu_features() -> CPUFeatures:
    model_name, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model_name:
                    model_name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model_name and flags:
                    break
    except OSError:  # not Linux: no cheap way to tell, so report no features (the safe side)
        pass
    return CPUFeatures(platform.machine(), model_name, flags)


def cpu_has_amx() -> bool:
    """True when the CPU advertises AMX bf16 tiles."""
    return cpu_features().amx_bf16
