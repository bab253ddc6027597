"""What this CPU offers: its model and feature flags, read from /proc/cpuinfo once, and its
cache sizes, read from sysfs once.

The native library's cache key, the `auto` dtype (bf16 where the CPU computes it natively),
the choice of linear kernel and the tests' skip reasons all read these, so the file is parsed
in one place (`parse_cpuinfo`, tested with recorded samples of each kind of CPU).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CPUFeatures:
    machine: str  # platform.machine(), e.g. "x86_64" or "aarch64"
    model_name: str  # "" where /proc/cpuinfo is absent (not Linux)
    flags: frozenset[str]  # x86 "flags", aarch64 "Features"

    @property
    def amx_bf16(self) -> bool:
        """AMX bf16 tiles (Sapphire Rapids and later)."""
        return "amx_bf16" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        """vdpbf16ps on 512-bit vectors (Cooper Lake, Sapphire Rapids and later, AMD Zen 4/5)."""
        return "avx512_bf16" in self.flags and "avx512f" in self.flags

    @property
    def avx2(self) -> bool:
        """8-lane fp32 vectors with FMA (Haswell and later, AMD Zen): the native kernels' floor."""
        return "avx2" in self.flags and "fma" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags and "avx512bw" in self.flags

    @property
    def arm_bf16(self) -> bool:
        """aarch64 BFDOT/BFMMLA (Neoverse V1/N2 and later: Graviton 3, Grace, Axion)."""
        return self.machine in ("aarch64", "arm64") and "bf16" in self.flags

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 products run in hardware here rather than emulated through fp32."""
        return self.amx_bf16 or self.avx512_bf16 or self.arm_bf16

    @property
    def missing_bf16(self) -> str:
        """The feature a bf16 fast path lacks here, for messages and test skips."""
        if self.machine in ("aarch64", "arm64"):
            return "" if self.arm_bf16 else "bf16 (aarch64)"
        return "" if self.avx512_bf16 or self.amx_bf16 else "avx512_bf16"

    @property
    def signature(self) -> str:
        """Machine, model and flags: a library built with -march=native runs only where these match."""
        return f"{self.machine}|{self.model_name}|{' '.join(sorted(self.flags))}"


def parse_cpuinfo(text: str, machine: str) -> CPUFeatures:
    """The first processor's model and flags in /proc/cpuinfo text. x86 names the model in
    "model name" and the features in "flags"; aarch64 has neither, only "Features" and the
    implementer/part codes, which then stand for the model."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            if fields:  # a blank line ends the first processor's block
                break
            continue
        fields.setdefault(key, value.strip())
    model = fields.get("model name") or fields.get("Model Name") or ""
    if not model and "CPU part" in fields:
        model = f"implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    flags = fields.get("flags") or fields.get("Features") or ""
    return CPUFeatures(machine, model, frozenset(flags.split()))


# Cached: the CPU does not change under a running process, and /proc/cpuinfo is long.
@functools.cache
def cpu_features() -> CPUFeatures:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return parse_cpuinfo(f.read(), platform.machine())
    except OSError:  # not Linux: no cheap way to tell, so report no features (the safe side)
        return CPUFeatures(platform.machine(), "", frozenset())


def cpu_has_native_bf16() -> bool:
    """True when bf16 arithmetic runs in hardware on this CPU (see CPUFeatures.native_bf16)."""
    return cpu_features().native_bf16


@dataclass(frozen=True, slots=True)
class CPUCaches:
    """Data cache sizes in bytes (0 where unknown): L2 as one core has it, L3 as the cores share it."""

    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int


def parse_cache_size(text: str) -> int:
    """sysfs's "512K" / "32768K" / "1M" as bytes (0 for anything else)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else 0


def read_caches(cache_dir: Path) -> CPUCaches:
    """The data and unified caches listed under one CPU's sysfs cache folder
    (/sys/devices/system/cpu/cpu0/cache: index*/level, type, size)."""
    sizes = {1: 0, 2: 0, 3: 0}
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and level in sizes:
            sizes[level] = max(sizes[level], size)
    return CPUCaches(sizes[1], sizes[2], sizes[3])


@functools.cache
def cpu_caches() -> CPUCaches:
    """This machine's caches (all 0 where sysfs does not list them: not Linux, some containers)."""
    return read_caches(Path("/sys/devices/system/cpu/cpu0/cache"))
