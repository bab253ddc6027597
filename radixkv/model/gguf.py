"""Reading a GGUF file's weights directly: its tensor table under transformers' names, each
tensor's bytes read on demand with plain file reads, and the Llama q/k row order undone exactly as
transformers' GGUF loader undoes it. Config and tokenizer come from transformers (radixkv.model.loader).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from radixkv.cpu.quant import QuantWeight

# Stored as floats: loaded in the compute dtype under every weight_dtype.
FLOAT_TYPES = ("F32", "F16", "BF16")
# llama.cpp permutes q/k rows of these architectures for its rope layout (transformers'
# LlamaTensorProcessor undoes it for "llama" only).
_PERMUTED_ARCHITECTURES = ("llama",)
_SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp stores that transformers' models compute themselves (llama3 rope factors).
_SKIPPED = ("rope_freqs.weight",)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file radixkv cannot read: malformed, truncated, or holding what it does not support."""


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    name: str  # transformers' name, e.g. model.layers.0.self_attn.q_proj.weight
    gguf_name: str  # the file's, e.g. blk.0.attn_q.weight
    type_name: str  # ggml type: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # in torch order: (out_features, in_features) for a matrix
    byte_shape: tuple[int, ...]  # the array GGUFReader gives for it (rows of blocks for quantized types)
    offset: int  # of its bytes in the file
    nbytes: int
    permute_heads: int | None  # reverse-permute rows in this many heads (Llama q/k), else None

    @property
    def quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES


class GGUFFile:
    """One GGUF file's tensor table; tensors are read one at a time, with file reads rather than
    through the reader's memory map, so file pages never count as this process's memory."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            reader = GGUFReader(self.path, "r")
        except Exception as exc:  # the reader raises anything from ValueError to IndexError on bad bytes
            raise GGUFError(f"{str(self.path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.architecture = _architecture(reader, self.path)
        size = self.path.stat().st_size
        permute = self.architecture in _PERMUTED_ARCHITECTURES
        self.tensors: dict[str, GGUFTensor] = {}
        for tensor in reader.tensors:
            if tensor.name in _SKIPPED:
                continue
            name = hf_name(tensor.name)
            if name is None:
                raise GGUFError(f"{str(self.path)!r} holds tensor {tensor.name!r}, which radixkv does not know")
            offset, nbytes = int(tensor.data_offset), int(tensor.n_bytes)
            if offset + nbytes > size:
                raise GGUFError(
                    f"{str(self.path)!r} is truncated: tensor {tensor.name!r} ends at byte {offset + nbytes}, "
                    f"the file has {size}"
                )
            heads = None
            if permute and ".attn_q." in tensor.name:
                heads = num_heads
            elif permute and ".attn_k." in tensor.name:
                heads = num_kv_heads
            self.tensors[name] = GGUFTensor(
                name=name,
                gguf_name=tensor.name,
                type_name=tensor.tensor_type.name,
                shape=tuple(int(d) for d in reversed(tensor.shape.tolist())),
                byte_shape=tuple(int(d) for d in tensor.data.shape),
                offset=offset,
                nbytes=nbytes,
                permute_heads=heads,
            )
        del reader  # its memory map: nothing more is read through it

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors radixkv reads from the file."""
        return sum(t.nbytes for t in self.tensors.values())

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as GGUFReader would give them (dtype and shape alike), in the file's row order."""
        info = self.tensors[name]
        data = np.empty(info.nbytes, dtype=np.uint8)
        view = memoryview(data)
        with open(self.path, "rb", buffering=0) as file:
            file.seek(info.offset)
            done = 0
            while done < info.nbytes:
                count = file.readinto(view[done:])
                if not count:
                    raise GGUFError(f"{str(self.path)!r} ended inside tensor {info.gguf_name!r}")
                done += count
        item = {"F32": np.float32, "F16": np.float16}.get(info.type_name)
        if item is not None:
            return data.view(item).reshape(info.byte_shape)
        return data.reshape(info.byte_shape)

    def dequantized(self, name: str) -> Tensor:
        """The tensor in fp32, the values transformers' GGUF loader produces."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        try:
            values = dequantize(self.raw(name), GGMLQuantizationType[info.type_name])
        except NotImplementedError as exc:
            raise GGUFError(f"tensor {info.gguf_name!r} of {str(self.path)!r} is {info.type_name}, which cannot be dequantized here") from exc
        values = np.asarray(values, dtype=np.float32).reshape(info.shape)
        if info.permute_heads is not None:
            values = values[row_permutation(info.shape[0], info.permute_heads)]
        return torch.from_numpy(np.ascontiguousarray(values))

    def quantized(self, name: str) -> QuantWeight:
        """The tensor's blocks as a QuantWeight (radixkv.cpu.quant.from_gguf: Q8_0 and 4-bit
        formats as they are, other k-quants requantized), rows in transformers' order."""
        from radixkv.cpu.quant import from_gguf

        info = self.tensors[name]
        if len(info.shape) != 2:
            raise GGUFError(f"tensor {info.gguf_name!r} of {str(self.path)!r} is not a matrix: {info.shape}")
        try:
            weight = from_gguf(info.type_name, self.raw(name), shape=(info.shape[0], info.shape[1]))
        except ValueError as exc:
            raise GGUFError(
                f"tensor {info.gguf_name!r} of {str(self.path)!r} is {info.type_name}, which radixkv cannot keep "
                f"quantized ({exc}); load it with weight_dtype='float'"
            ) from exc
        if info.permute_heads is not None:
            weight = weight.rows(torch.from_numpy(row_permutation(info.shape[0], info.permute_heads)))
        return weight


def hf_name(gguf_name: str) -> str | None:
    """transformers' name for a Llama-family GGUF tensor name, None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"


def row_permutation(rows: int, heads: int) -> np.ndarray:
    """Row indices undoing llama.cpp's q/k permutation: out[i] = w[index[i]], the rows
    transformers' _reverse_permute_weights produces (per head, interleaved halves to split halves)."""
    dim = rows // heads // 2
    assert heads * dim * 2 == rows, "q/k rows split evenly into heads of two halves"
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)


def _architecture(reader: object, path: Path) -> str:
    field = reader.fields.get("general.architecture")  # type: ignore[attr-defined]
    if field is None:
        raise GGUFError(f"{str(path)!r} has no general.architecture")
    name = bytes(field.parts[field.data[0]]).decode("utf-8")
    if name not in _SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{str(path)!r} is a {name!r} model; radixkv reads GGUF files of {list(_SUPPORTED_ARCHITECTURES)}")
    return name
