"""The logits kernels (radixkv/cpu/csrc/logits.c) as tensor functions: a grammar's token bitmask
applied in place, the greedy argmax and the non-finite rows, for fp32 rows on CPU.

Each returns what it did, or None / False where the tensors do not fit the kernel or the library
cannot be built, so the caller takes its own path (xgrammar, torch) instead.
"""

from __future__ import annotations

import torch

from radixkv.cpu.native import load


def _library_for(logits: torch.Tensor):
    """The native library where these logits are fp32 rows on CPU with unit inner stride, else None."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        return load()
    return None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """Disallowed tokens of logits' `rows` to -inf in place, each row by the bitmask row of the same
    index (int32 words, bit j of word i allows token 32 * i + j); False where the kernel cannot."""
    fits = (
        bitmask.dtype == torch.int32 and bitmask.is_contiguous()
        and bitmask.shape[0] >= logits.shape[0] and bitmask.shape[1] * 32 >= logits.shape[-1]
    )  # fmt: skip
    library = _library_for(logits) if fits else None
    if library is None:
        return False
    row_ids = torch.tensor(rows, dtype=torch.int32)
    library.radixkv_apply_token_bitmask_f32(
        logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
        row_ids.data_ptr(), len(rows), logits.shape[1],
    )  # fmt: skip
    return True


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's first maximum's index (int64), a NaN above every number; None where the kernel
    cannot run."""
    library = _library_for(logits)
    if library is None or logits.shape[1] == 0:
        return None
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    library.radixkv_argmax_rows_f32(
        logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], tokens.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return tokens


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """A bool per row, True where it holds a NaN or an infinity; None where the kernel cannot run."""
    library = _library_for(logits)
    if library is None:
        return None
    bad = torch.empty(logits.shape[0], dtype=torch.bool)
    library.radixkv_nonfinite_rows_f32(
        logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], bad.data_ptr(), torch.get_num_threads()
    )
    return bad
