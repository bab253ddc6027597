"""The native sources compile without a warning (-Wall -Wextra) for each kind of x86 CPU, those
this machine cannot run included, and for aarch64 where a cross compiler is installed: a
warning in a path no test here executes (an unused parameter, a helper left without its
caller) is otherwise found only on the other machine."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from radixkv.cpu import native
from radixkv.cpu.features import cpu_features

COMPILER = native.find_compiler()

# The build each kind of CPU gets: no AVX2 (the portable loops), AVX2 (Haswell to Alder Lake,
# Zen 1-3), AVX-512 without BF16 (Skylake to Ice Lake), AVX512_BF16 without AMX (Cooper Lake;
# Zen 4's kernels), AMX (Sapphire Rapids and later).
MARCHES = ["x86-64-v2", "x86-64-v3", "skylake-avx512", "cooperlake", "sapphirerapids"]


# ARM servers build the portable loops (Graviton 2: armv8.2-a; Graviton 3, Grace: with bf16).
AARCH64_COMPILER = shutil.which("aarch64-linux-gnu-gcc")
AARCH64_MARCHES = ["armv8.2-a", "armv8.6-a+bf16+sve"]


def compile_only(march: str, *extra: str, compiler: str | None = COMPILER) -> subprocess.CompletedProcess:
    flags = [flag for flag in native.COMPILE_FLAGS if flag not in ("-march=native", "-shared", "-fPIC")]
    command = [compiler, "-fsyntax-only", f"-march={march}", *flags, *extra, *map(str, native.SOURCES)]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
@pytest.mark.skipif(cpu_features().machine != "x86_64", reason="the builds are x86-64 ones")
@pytest.mark.parametrize("march", MARCHES)
def test_sources_compile_without_warnings(march) -> None:
    probe = subprocess.run([COMPILER, f"-march={march}", "-x", "c", "-fsyntax-only", "-"], input="", capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{COMPILER} lacks -march={march}")
    result = compile_only(march, "-Wall", "-Wextra", "-Werror")
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(AARCH64_COMPILER is None, reason="no aarch64 cross compiler (Debian: gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("march", AARCH64_MARCHES)
def test_sources_compile_for_aarch64_without_warnings(march) -> None:
    result = compile_only(march, "-Wall", "-Wextra", "-Werror", compiler=AARCH64_COMPILER)
    assert result.returncode == 0, result.stderr
