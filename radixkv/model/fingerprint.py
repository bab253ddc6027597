"""What makes a model's KV what it is, as one string: a digest of its weight files (a GGUF's
file itself), the weight format, the dtype, the pages' storage dtype (kv_dtype), the attention
shape and the rope settings. The disk KV tier stores it with every block and
treats any other fingerprint as a miss.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from radixkv.cache.kv_dtype import kv_dtype_name
from radixkv.model.loader import LoadedModel, _weight_files

# Files up to this size are hashed whole; larger ones by their size, their first and last
# megabytes and a few in between (a safetensors header, at the start, names every tensor's
# shape and offset), so a start costs milliseconds, not a read of many gigabytes.
_FULL_HASH_BYTES = 256 << 20
_SAMPLE_BYTES = 1 << 20
_NUM_SAMPLES = 8
# Raised whenever the kernels' arithmetic changes the KV a given file computes (Q6_K read as
# the file stores it instead of requantized; the experts' lanes summed in another order; Gemma's
# norms in native code; bf16 decode attention's p.v on bf16-rounded weights), so a disk tier
# written by an older build is a miss, never a block that recomputing would not give.
KV_NUMERICS_REVISION = 3


def model_fingerprint(loaded: LoadedModel, kv_dtype: torch.dtype | None = None) -> str:
    """kv_dtype: the pages' storage dtype (None: the compute dtype): a block stored under
    another is another block's bytes, so a miss."""
    config = loaded.config
    fields = {
        "weights": weights_digest(weight_files(loaded)),
        # KV computed with weights kept quantized differs from the float model's.
        "weight_format": loaded.weight_format,
        "numerics": KV_NUMERICS_REVISION,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv_dtype": kv_dtype_name(kv_dtype if kv_dtype is not None else loaded.dtype),
        "architecture": config.architecture,
        "layers": config.num_layers,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "qk_norm": config.qk_norm,
    }
    return json.dumps(fields, sort_keys=True, default=str)


def weight_files(loaded: LoadedModel) -> list[Path]:
    """The files the loader read the weights from, not the per-dtype cast copies it may add later."""
    if loaded.gguf is not None:
        return [Path(loaded.gguf)]
    folder = Path(loaded.path)
    return _weight_files(folder, "model.safetensors") or _weight_files(folder, "pytorch_model.bin")


def weights_digest(files: list[Path]) -> str:
    """sha256 over weight files (names, sizes, and contents or samples of them)."""
    hasher = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        hasher.update(f"{path.name}|{size}|".encode())
        with path.open("rb") as handle:
            if size <= _FULL_HASH_BYTES:
                for chunk in iter(lambda: handle.read(1 << 22), b""):
                    hasher.update(chunk)
                continue
            step = max(1, (size - _SAMPLE_BYTES) // (_NUM_SAMPLES - 1))
            for i in range(_NUM_SAMPLES):
                handle.seek(min(i * step, size - _SAMPLE_BYTES))
                hasher.update(handle.read(_SAMPLE_BYTES))
    return hasher.hexdigest()
