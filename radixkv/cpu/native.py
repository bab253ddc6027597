"""radixkv's native CPU kernels (radixkv/cpu/csrc/*.c): compiled once per machine, loaded with ctypes.

The shared library is built with the system C compiler for this CPU (-march=native) and kept
in the radixkv cache folder under a name hashed from the sources, the flags and the CPU, so a
second process loads it in milliseconds. Without a compiler, callers take their torch paths;
EngineConfig.native_kernels=False makes them take those paths without asking for the library.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from radixkv import private_files
from radixkv.config import default_cache_dir
from radixkv.cpu.features import cpu_features

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_decode.c", CSRC / "paged_decode_avx2.c", CSRC / "paged_decode_narrow.c", CSRC / "cascade.c", CSRC / "paged_extend.c", CSRC / "row_ops.c", CSRC / "packed_linear.c", CSRC / "linear_f32.c", CSRC / "decode_layers.c", CSRC / "logits.c", CSRC / "quant_linear.c", CSRC / "quant_linear_zmm.c", CSRC / "moe.c", CSRC / "moe_mxfp4.c", CSRC / "gemma_ops.c")
HEADERS = (CSRC / "bf16.h", CSRC / "amx.h", CSRC / "decode.h", CSRC / "tiles.h", CSRC / "kernels.h")
COMPILE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def find_compiler() -> str | None:
    """The C compiler the library is built with: $CC, else cc, else gcc; None where none is."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built (no compiler, not Linux)."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        compiler = find_compiler()
        if compiler is None or platform.system() != "Linux":
            logger.warning("no C compiler found: radixkv runs its CPU kernels as torch ops (slower decode)")
            return None
        try:
            library = build_from(CSRC, compiler)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            logger.warning("building radixkv's CPU kernels failed, using torch ops instead: %s", detail)
            return None
        _library = library
        return library


def build_from(csrc: Path, compiler: str) -> ctypes.CDLL:
    """The library compiled from the sources in `csrc` (this package's, or another revision's),
    built once into the cache and loaded with its functions declared; raises where it fails."""
    path = _library_path(compiler, csrc)
    if not path.exists():
        _build(compiler, csrc, path)
    check_private(path)
    library = ctypes.CDLL(str(path))
    _declare(library)
    # Decode's q.k starts on AMX where the OS grants tiles, as EngineConfig.decode_amx's
    # default says; the CPU backend applies its own config's setting over this.
    library.radixkv_decode_use_amx(1)
    return library


@contextlib.contextmanager
def using(library: ctypes.CDLL) -> Iterator[ctypes.CDLL]:
    """Every kernel call within runs `library` (two builds timed against each other in one
    process: scenarios/native_ab.py); the loaded one is back after."""
    global _library, _tried
    with _lock:
        saved = _library, _tried
        _library, _tried = library, True
    try:
        yield library
    finally:
        with _lock:
            _library, _tried = saved


def _library_path(compiler: str, csrc: Path) -> Path:
    key = hashlib.sha256()
    for source in (*_sources(csrc), *sorted(csrc.glob("*.h"))):
        key.update(source.name.encode())
        key.update(source.read_bytes())
    # A library built with -march=native runs only on this CPU model with these flags.
    for part in (compiler, " ".join(COMPILE_FLAGS), cpu_features().signature):
        key.update(part.encode())
    return default_cache_dir() / "native" / f"radixkv-{key.hexdigest()[:16]}.so"


def check_private(library: Path) -> None:
    """PermissionError unless the library and its folder belong to this user and no one else
    may write them: loading a library runs its code, so another user able to swap it (a shared
    or world-writable cache) could run theirs in this process."""
    private_files.check_private(library.parent, library)


def _sources(csrc: Path) -> list[Path]:
    """The C files of `csrc` (this package's: SOURCES; another revision's: whatever it had, so
    scenarios/native_ab.py builds a base from before a file was added)."""
    return sorted(csrc.glob("*.c"))


def _build(compiler: str, csrc: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)  # check_private: no one else writes it
    # Build beside the target and rename: a concurrent process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *COMPILE_FLAGS, "-o", tmp, *map(str, _sources(csrc)), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)  # whatever the umask: check_private refuses a group-writable library
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(library: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "radixkv_paged_decode_bf16": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32],
        "radixkv_paged_decode_f32": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32],
        "radixkv_paged_decode_f32_kv": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32, p, p, i32],
        "radixkv_paged_decode_bf16_kv": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32, p, p, i32],
        "radixkv_paged_decode_bf16_sinks": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32, p],
        "radixkv_paged_decode_f32_sinks": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32, p],
        "radixkv_paged_decode_f32_kv_sinks": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32, p, p, i32, p],
        "radixkv_paged_decode_bf16_kv_sinks": [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32, i32, p, p, i32, p],
        "radixkv_decode_kv_fits": [i32, i32],
        "radixkv_store_kv_narrow": [p, p, p, p, p, p, i64, i64, p, i32, i32, i32, i32],
        "radixkv_store_kv_narrow_bf16": [p, p, p, p, p, p, i64, i64, p, i32, i32, i32],
        "radixkv_paged_extend_bf16": [p, i64, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, f32, p, i64, i32, i32, p],
        "radixkv_paged_extend_f32": [p, i64, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, f32, p, i64, i32, i32, p],
        "radixkv_paged_extend_fits": [i32, i32, i32],
        "radixkv_cascade_plan": [p, i64, p, i32, i32, i32, i32, i64, p],
        "radixkv_cascade_plan_exact": [p, i32],
        "radixkv_cascade_plan_ints": [i32],
        "radixkv_decode_work_floats": [p, i32, p, i32, i32, i32],
        "radixkv_decode_use_amx": [i32],
        "radixkv_cascade_use_tiles": [i32],
        "radixkv_dpbf16_matches_fma": [],
        "radixkv_decode_limits": [p, p, p],
        "radixkv_store_kv": [p, p, p, p, i64, i64, p, i32, i64],
        "radixkv_add_rms_norm_bf16": [p, p, p, p, i32, i32, f32, i32],
        "radixkv_rope_bf16": [p, i64, i32, i32, i32, p, p, i32],
        "radixkv_silu_mul_bf16": [p, i64, p, i32, i32, i32],
        "radixkv_add_rms_norm_f32": [p, p, p, p, i32, i32, f32, i32],
        "radixkv_rope_f32": [p, i64, i32, i32, i32, p, p, i32],
        "radixkv_silu_mul_f32": [p, i64, p, i32, i32, i32],
        "radixkv_linear_kernels": [],
        "radixkv_packed_words": [i32, i32],
        "radixkv_pack_weight": [p, i32, i32, p],
        "radixkv_packed_linear": [i32, p, i64, i32, i32, p, i32, p, p, i64, i32],
        "radixkv_packed_floats_f32": [i32, i32],
        "radixkv_pack_weight_f32": [p, i32, i32, p],
        "radixkv_packed_linear_f32": [p, i64, i32, i32, p, i32, p, p, i64, i32],
        "radixkv_apply_token_bitmask_f32": [p, i64, p, i64, p, i32, i32],
        "radixkv_argmax_rows_f32": [p, i64, i32, i64, p, i32],
        "radixkv_nonfinite_rows_f32": [p, i64, i32, i64, p, i32],
        "radixkv_decode_layers": [p, i32, i32, p, p, p, p, p],
        "radixkv_gemma_norm_bf16": [p, i64, p, p, p, i64, i32, i32, i32, f32, i32],
        "radixkv_gemma_norm_f32": [p, i64, p, p, p, i64, i32, i32, i32, f32, i32],
        "radixkv_gelu_mul_bf16": [p, i64, p, i32, i32, i32],
        "radixkv_gelu_mul_f32": [p, i64, p, i32, i32, i32],
        "radixkv_quant_linear_kernels": [],
        "radixkv_quant_packed_bytes": [i32, i32, i32],
        "radixkv_quant_pack": [i32, p, p, p, i32, i32, p],
        "radixkv_quant_dequant_rows": [i32, p, i32, i32, p, i32, p],
        "radixkv_quant_linear": [i32, i32, p, i32, i64, i32, i32, p, i32, p, p, i64, i32],
        "radixkv_quant_zmm_packed_bytes": [i32, i32, i32],
        "radixkv_quant_zmm_pack": [i32, p, p, p, i32, i32, p],
        "radixkv_quant_zmm_dequant_rows": [i32, p, i32, i32, p, i32, p],
        "radixkv_moe_row_bytes": [i32, i32],
        "radixkv_moe_grouped": [i32, p, i64, i32, i32, p, i64, i32, p, p, i32, p, p, i64, i32, i32],
        "radixkv_moe_has_vnni": [],
        "radixkv_moe_row_gate_up": [i32, p, i32, p, i32, i32, p, p, i32, p, i32, i32],
        "radixkv_moe_row_down": [i32, p, i32, i32, p, p, p, i32, p, i32, i32, i32],
        "radixkv_moe_grouped_f32": [p, i64, i32, i32, p, i64, p, p, i32, p, p, i64, i32],
        "radixkv_moe_token": [p, i32, i32, p, p, i32, i32, p, i32, p, i32, p, i32, p, p, i32, i32],
        "radixkv_moe_token_floats": [i32, i32, i32],
        "radixkv_moe_mxfp4_kernels": [],
        "radixkv_moe_mxfp4": [p, i64, i32, i32, p, i64, p, p, i32, p, p, p, i64, i32, i32],
    }
    returns = {
        "radixkv_paged_decode_bf16": i32,
        "radixkv_paged_decode_f32": i32,
        "radixkv_paged_decode_f32_kv": i32,
        "radixkv_paged_decode_bf16_kv": i32,
        "radixkv_paged_decode_bf16_sinks": i32,
        "radixkv_paged_decode_f32_sinks": i32,
        "radixkv_paged_decode_f32_kv_sinks": i32,
        "radixkv_paged_decode_bf16_kv_sinks": i32,
        "radixkv_decode_kv_fits": i32,
        "radixkv_decode_work_floats": i64,
        "radixkv_paged_extend_bf16": i32,
        "radixkv_paged_extend_f32": i32,
        "radixkv_paged_extend_fits": i32,
        "radixkv_cascade_plan": i64,
        "radixkv_cascade_plan_exact": i64,
        "radixkv_cascade_plan_ints": i64,
        "radixkv_decode_use_amx": i32,
        "radixkv_cascade_use_tiles": i32,
        "radixkv_dpbf16_matches_fma": i32,
        "radixkv_linear_kernels": i32,
        "radixkv_packed_words": i64,
        "radixkv_packed_linear": i32,
        "radixkv_packed_floats_f32": i64,
        "radixkv_packed_linear_f32": i32,
        "radixkv_decode_layers": i32,
        "radixkv_quant_linear_kernels": i32,
        "radixkv_quant_packed_bytes": i64,
        "radixkv_quant_linear": i32,
        "radixkv_quant_zmm_packed_bytes": i64,
        "radixkv_moe_row_bytes": i64,
        "radixkv_moe_grouped": i32,
        "radixkv_moe_has_vnni": i32,
        "radixkv_moe_row_gate_up": i32,
        "radixkv_moe_row_down": i32,
        "radixkv_moe_grouped_f32": i32,
        "radixkv_moe_token": i32,
        "radixkv_moe_token_floats": i64,
        "radixkv_moe_mxfp4_kernels": i32,
        "radixkv_moe_mxfp4": i32,
    }
    for name, argtypes in signatures.items():
        if not hasattr(library, name):  # another revision's build, from before `name` was added
            continue
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = returns.get(name)
