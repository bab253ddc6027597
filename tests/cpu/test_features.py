"""CPU detection in one place (radixkv/cpu/features.py) against recorded /proc/cpuinfo samples of
each kind of CPU radixkv runs on: which have native bf16 (so `auto` means bf16), which linear
kernels their flags allow, and that the library's cache key tells them all apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.cpu import features
from radixkv.cpu.features import parse_cpuinfo

SAMPLES = Path(__file__).parent / "cpuinfo"

# sample: (machine, model, native bf16, amx, avx512_bf16, what a bf16 fast path lacks)
EXPECTED = {
    "intel_sapphire_rapids": ("x86_64", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", True, True, True, ""),
    "amd_epyc_zen4": ("x86_64", "AMD EPYC", True, False, True, ""),
    "amd_epyc_zen3": ("x86_64", "AMD EPYC", False, False, False, "avx512_bf16"),
    "intel_skylake_avx512": ("x86_64", "Intel(R) Xeon(R) Platinum 8175M CPU @ 2.50GHz", False, False, False, "avx512_bf16"),
    "intel_broadwell_avx2": ("x86_64", "Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz", False, False, False, "avx512_bf16"),
    "aws_graviton3": ("aarch64", "implementer 0x41 part 0xd40", True, False, False, ""),
    "aws_graviton2": ("aarch64", "implementer 0x41 part 0xd0c", False, False, False, "bf16 (aarch64)"),
}


def load(name: str):
    machine = EXPECTED[name][0]
    return parse_cpuinfo((SAMPLES / f"{name}.txt").read_text(), machine)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_kind_of_cpu_is_read_right(name):
    machine, model, native_bf16, amx, avx512_bf16, missing = EXPECTED[name]
    features = load(name)
    assert (features.machine, features.model_name) == (machine, model)
    assert features.native_bf16 == native_bf16
    assert (features.amx_bf16, features.avx512_bf16) == (amx, avx512_bf16)
    assert features.missing_bf16 == missing


def test_avx2_is_every_x86_samples_floor_and_no_arm_ones():
    # The native kernels' 8-lane items need AVX2 with FMA: every x86 sample has them (Broadwell
    # and Zen 3 have nothing wider), no aarch64 one does.
    assert {name for name in EXPECTED if load(name).avx2} == {name for name in EXPECTED if EXPECTED[name][0] == "x86_64"}
    assert not load("amd_epyc_zen3").avx512 and load("amd_epyc_zen4").avx512


def test_only_the_first_processor_is_read():
    # Later processors' blocks (cut short in the samples) must not replace the first one's flags.
    assert "amx_tile" in load("intel_sapphire_rapids").flags
    assert "bf16" in load("aws_graviton3").flags


def test_the_cache_key_tells_every_kind_apart():
    signatures = {load(name).signature for name in EXPECTED}
    assert len(signatures) == len(EXPECTED)
    # aarch64 has no "flags" line: its Features must reach the key, or Graviton 2 and 3 collide.
    assert "bf16" in load("aws_graviton3").signature and "bf16" not in load("aws_graviton2").signature


def test_empty_cpuinfo_means_no_features():
    features = parse_cpuinfo("", "x86_64")
    assert features.flags == frozenset() and not features.native_bf16 and features.model_name == ""


def _cache_index(folder, name, level, kind, size):
    index = folder / name
    index.mkdir(parents=True)
    (index / "level").write_text(f"{level}\n")
    (index / "type").write_text(f"{kind}\n")
    (index / "size").write_text(f"{size}\n")


def test_cache_sizes_are_read_from_sysfs(tmp_path):
    # A Zen 3 core as sysfs lists it: split L1, the core's L2, the CCX's L3.
    _cache_index(tmp_path, "index0", 1, "Data", "32K")
    _cache_index(tmp_path, "index1", 1, "Instruction", "32K")
    _cache_index(tmp_path, "index2", 2, "Unified", "512K")
    _cache_index(tmp_path, "index3", 3, "Unified", "32768K")
    assert features.read_caches(tmp_path) == features.CPUCaches(32 << 10, 512 << 10, 32 << 20)


def test_caches_sysfs_does_not_list_read_as_unknown(tmp_path):
    _cache_index(tmp_path, "index0", 1, "Data", "48K")
    (tmp_path / "index9").mkdir()  # an entry without its files is skipped, not an error
    assert features.read_caches(tmp_path) == features.CPUCaches(48 << 10, 0, 0)
    assert features.read_caches(tmp_path / "absent") == features.CPUCaches(0, 0, 0)


@pytest.mark.parametrize(("text", "size"), [("512K", 512 << 10), ("2M", 2 << 20), ("1G", 1 << 30), ("4096", 4096), ("", 0), ("big", 0)])
def test_cache_size_text(text, size):
    assert features.parse_cache_size(text) == size
