"""The CPU paged-decode kernel (csrc/paged_decode.c): compiled once per machine, loaded with ctypes.

The shared library is built with the system C compiler for this CPU (-march=native) and kept
in the radixkv cache folder under a name hashed from the source, the flags and the CPU, so a
second process loads it in milliseconds. Without a compiler the torch backend gathers instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from radixkv.config import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# RADIXKV_NATIVE_DECODE=0 turns the kernel off (the torch backend then gathers KV per step).
DISABLE_ENV = "RADIXKV_NATIVE_DECODE"
# RADIXKV_DECODE_AMX=0 keeps q.k on AVX-512 even where AMX tiles are available.
AMX_ENV = "RADIXKV_DECODE_AMX"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    """The CPU's model and feature flags: a library built with -march=native runs only there."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), " ".join(COMPILE_FLAGS).encode(), _cpu_signature().encode()):
        key.update(part)
    return default_cache_dir() / "native" / f"paged_decode-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *COMPILE_FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(library: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    for name in ("radixkv_paged_decode_bf16", "radixkv_paged_decode_f32"):
        function = getattr(library, name)
        function.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, p, p, p, i32]
        function.restype = ctypes.c_int
    library.radixkv_decode_work_floats.argtypes = [p, i32, i32, i32]
    library.radixkv_decode_work_floats.restype = i64
    library.radixkv_decode_use_amx.argtypes = []
    library.radixkv_decode_use_amx.restype = ctypes.c_int


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built (no compiler, not Linux)."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get(DISABLE_ENV, "1") in ("0", ""):
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None or platform.system() != "Linux":
            logger.warning("no C compiler found: CPU decode gathers KV pages each step (slower)")
            return None
        path = _library_path(compiler)
        try:
            if not path.exists():
                _build(compiler, path)
            library = ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            logger.warning("building the CPU decode kernel failed, falling back to gathering KV: %s", detail)
            return None
        _declare(library)
        if os.environ.get(AMX_ENV, "1") not in ("0", ""):
            library.radixkv_decode_use_amx()
        _library = library
        return library


# The kernel's fixed-size buffers (MAX_HEAD_DIM, MAX_GROUP in csrc/paged_decode.c).
MAX_HEAD_DIM, MAX_GROUP = 256, 16
_FUNCTIONS = {torch.bfloat16: "radixkv_paged_decode_bf16", torch.float32: "radixkv_paged_decode_f32"}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, bf16/fp32, contiguous pages, unit inner stride)."""
    return (
        q.device.type == "cpu"
        and q.dtype in _FUNCTIONS
        and k_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and k_cache.dim() == 4
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
        and q.shape[-1] <= MAX_HEAD_DIM
        and k_cache.shape[2] > 0
        and q.shape[1] % k_cache.shape[2] == 0
        and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
        and load() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Attention of one query per request over its paged KV, without copying the KV.

    q: [R, num_q_heads, head_dim] (rows may be strided); page_table: [B, P] int32; seq_lens:
    [B] int32; rows: [B] int32, the q/out row of each request (None: row b). Returns out
    [R, num_q_heads, head_dim], contiguous; rows no request names are left as they were.
    check=False skips the index checks, for a caller that checked these same tables already
    (every layer of a step reads the same ones).
    """
    library = load()
    assert library is not None, "call supports() first"
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    page_table = page_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if rows is not None:
        rows = rows.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    if check:
        _check_bounds(q, k_cache, v_cache, page_table, seq_lens, rows, out)
    work_floats = library.radixkv_decode_work_floats(seq_lens.data_ptr(), num_seqs, num_q_heads, head_dim)
    work = torch.empty(max(work_floats, 1), dtype=torch.float32)
    first_chunk = torch.empty(max(num_seqs, 1), dtype=torch.int64)
    status = getattr(library, _FUNCTIONS[q.dtype])(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(),
        rows.data_ptr() if rows is not None else None, num_seqs, num_q_heads, num_kv_heads, head_dim,
        page_size, scale, out.data_ptr(), work.data_ptr(), first_chunk.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"paged decode kernel rejected the shapes: {num_q_heads} query heads, {num_kv_heads} kv heads, head_dim {head_dim} (limits: group <= 16, head_dim <= 256)")
    return out


def _check_bounds(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """The C kernel trusts its indices; a bad one would read or write outside a tensor and take
    the process down, so they are checked here (a few microseconds per call on CPU)."""
    num_seqs, num_pages, page_size = seq_lens.shape[0], k_cache.shape[0], k_cache.shape[1]
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous():
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}, contiguous")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    if page_table.shape[0] != num_seqs or (rows is not None and rows.shape[0] != num_seqs):
        raise ValueError(f"page_table has {page_table.shape[0]} rows for {num_seqs} sequences")
    if num_seqs == 0:
        return
    if int(seq_lens.min()) < 0 or int(seq_lens.max()) > page_table.shape[1] * page_size:
        raise IndexError(f"sequence lengths must lie in [0, {page_table.shape[1] * page_size}] (page table width x page size)")
    if page_table.numel() and (int(page_table.min()) < 0 or int(page_table.max()) >= num_pages):
        raise IndexError(f"page ids must lie in [0, {num_pages})")
    if rows is None and num_seqs > q.shape[0]:
        raise IndexError(f"{num_seqs} sequences but q has {q.shape[0]} rows")
    if rows is not None and (int(rows.min()) < 0 or int(rows.max()) >= q.shape[0]):
        raise IndexError(f"rows must lie in [0, {q.shape[0]})")
