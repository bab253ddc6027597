"""Reading a GGUF file's weights directly: its tensor table under transformers' names, each
tensor's bytes read on demand with plain file reads, and the Llama q/k row order undone exactly as
transformers' GGUF loader undoes it. Config and tokenizer come from transformers (radixkv.model.loader).
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch
from torch import Tensor

from radixkv.cpu.mxfp4 import dequantize_mxfp4

if TYPE_CHECKING:
    from radixkv.cpu.quant import QuantWeight

# Stored as floats: loaded in the compute dtype under every weight_dtype.
FLOAT_TYPES = ("F32", "F16", "BF16")
# llama.cpp permutes q/k rows of these architectures for its rope layout (transformers'
# LlamaTensorProcessor undoes it for "llama" only).
_PERMUTED_ARCHITECTURES = ("llama",)
_SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss")
# llama.cpp stores Gemma's norm weights as 1 + w (its norm multiplies by the stored weight);
# transformers' Gemma3RMSNorm takes w, so w = stored - 1 in fp32 as transformers' loader computes.
_UNIT_OFFSET_NORM_ARCHITECTURES = ("gemma3",)

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
    "ffn_gate_inp": "mlp.gate",  # the experts' router (llama.cpp never quantizes it)
}
# Experts stacked in one 3-D tensor [experts, rows, inputs] (torch order): each expert's matrix is
# one contiguous run of the file's blocks, listed as its own tensor under transformers' names.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Gemma's four norms a layer: ffn_norm is the MLP's input norm there too, the others its own.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# gpt-oss's: the MLP's input norm is post_attention_norm, the router has a bias, a sink logit per
# query head (blk.N.attn_sinks.weight, transformers' self_attn.sinks), the experts' biases
# stacked [experts, rows] (mlp.experts.{gate,up,down}_bias: radixkv.model.gpt_oss reads them).
_GPT_OSS_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate",
    "ffn_up_exps": "mlp.experts.up",
    "ffn_down_exps": "mlp.experts.down",
}
# Tensors llama.cpp stores that transformers' models compute themselves (llama3 rope factors).
_SKIPPED = ("rope_freqs.weight",)
# Values converted at once by GGUFFile.quantized: bounds its temporaries (fp32 copies and the like).
_CONVERT_VALUES = 1 << 22
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
    through a memory map, so file pages never count as this process's memory. The exception is
    the stacked experts, read in place through `mapped` (radixkv.model.moe.MappedExperts)."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int) -> None:
        self.path = Path(path)
        try:
            header = _read_header(self.path)
        except GGUFError:
            raise
        except Exception as exc:  # struct.error, UnicodeDecodeError, ... on bad bytes
            raise GGUFError(f"{str(self.path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.architecture = header.architecture
        if self.architecture not in _SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{str(self.path)!r} is a {self.architecture!r} model; radixkv reads GGUF files of {list(_SUPPORTED_ARCHITECTURES)}"
            )
        size = self.path.stat().st_size
        permute = self.architecture in _PERMUTED_ARCHITECTURES
        self.tensors: dict[str, GGUFTensor] = {}
        # Stacked experts tensors as the file holds them, by our module name and part, e.g.
        # ("model.layers.0.mlp.experts", "gate_proj"): read in place through `mapped`.
        self.stacked: dict[tuple[str, str], GGUFTensor] = {}
        self._map: np.memmap | None = None
        for raw in header.tensors:
            if raw.name in _SKIPPED:
                continue
            block = _BLOCK.match(raw.name)
            if block is not None and block.group(2) in _EXPERT_NAMES and block.group(3) == "weight":
                self._check_within(raw, size)
                self.tensors.update((t.name, t) for t in expert_tensors(raw))
                self.stacked[(f"model.layers.{block.group(1)}.mlp.experts", _EXPERT_NAMES[block.group(2)])] = raw
                continue
            name = hf_name(raw.name, self.architecture)
            if name is None:
                raise GGUFError(f"{str(self.path)!r} holds tensor {raw.name!r}, which radixkv does not know")
            self._check_within(raw, size)
            heads = None
            if permute and ".attn_q." in raw.name:
                heads = num_heads
            elif permute and ".attn_k." in raw.name:
                heads = num_kv_heads
            self.tensors[name] = replace(raw, name=name, permute_heads=heads)

    def _check_within(self, raw: GGUFTensor, size: int) -> None:
        if raw.offset + raw.nbytes > size:
            raise GGUFError(
                f"{str(self.path)!r} is truncated: tensor {raw.name!r} ends at byte {raw.offset + raw.nbytes}, "
                f"the file has {size}"
            )

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the tensors radixkv reads from the file."""
        return sum(t.nbytes for t in self.tensors.values())

    def mapped(self, tensor: GGUFTensor) -> np.ndarray:
        """A tensor's bytes in place: a read-only view [*shape[:-1], row bytes] of one memory map
        of the file, so its pages are the page cache's (shared, dropped under pressure, read
        back on use), never a copy in this process's own memory."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        rows = math.prod(tensor.shape[:-1])
        view = self._map[tensor.offset : tensor.offset + tensor.nbytes]
        return view.reshape(*tensor.shape[:-1], tensor.nbytes // rows)

    def populate(self, tensor: GGUFTensor) -> None:
        """Map a mapped tensor's pages now (read from disk where the page cache lacks them), as
        llama.cpp does at load: otherwise every page's first touch faults during a decode step.
        The pages stay the page cache's, shared and dropped under pressure."""
        self.mapped(tensor)  # the map opened
        if not hasattr(getattr(self._map, "_mmap", None), "madvise"):
            return
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        length = tensor.offset + tensor.nbytes - start
        # MADV_POPULATE_READ (Linux 5.14; not named by Python 3.11's mmap); where refused,
        # WILLNEED still reads the pages into the page cache ahead of use.
        for advice in (getattr(mmap, "MADV_POPULATE_READ", 22), getattr(mmap, "MADV_WILLNEED", None)):
            if advice is None:
                continue
            try:
                self._map._mmap.madvise(advice, start, length)
                return
            except (OSError, ValueError):
                continue

    def raw(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor's bytes as GGUFReader would give them (dtype and shape alike), in the file's
        row order; rows=(start, stop): only those rows of a matrix."""
        info = self.tensors[name]
        shape, offset, nbytes = info.byte_shape, info.offset, info.nbytes
        if rows is not None:
            row_bytes = nbytes // info.shape[0]
            shape, offset, nbytes = (rows[1] - rows[0], *shape[1:]), offset + rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes
        data = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(data)
        with open(self.path, "rb", buffering=0) as file:
            file.seek(offset)
            done = 0
            while done < nbytes:
                count = file.readinto(view[done:])
                if not count:
                    raise GGUFError(f"{str(self.path)!r} ended inside tensor {info.gguf_name!r}")
                done += count
        item = {"F32": np.float32, "F16": np.float16}.get(info.type_name)
        if item is not None:
            return data.view(item).reshape(shape)
        return data.reshape(shape)

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
        if self.architecture in _UNIT_OFFSET_NORM_ARCHITECTURES and info.name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        if info.permute_heads is not None:
            values = values[row_permutation(info.shape[0], info.permute_heads)]
        return torch.from_numpy(np.ascontiguousarray(values))

    def quantized(self, name: str, requantize: bool = False, super_blocks: bool = False) -> QuantWeight:
        """The tensor's blocks as a QuantWeight (radixkv.cpu.quant.from_gguf: Q8_0 and 4-bit
        formats as they are, other k-quants requantized), rows in transformers' order.
        requantize: q8_0 from the dequantized values (quantize_q8_0), whatever the type.
        super_blocks: Q4_K and Q6_K kept as their blocks (q4_k, q6_k)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from radixkv.cpu.quant import from_gguf, quantize_q8_0

        info = self.tensors[name]
        if len(info.shape) != 2:
            raise GGUFError(f"tensor {info.gguf_name!r} of {str(self.path)!r} is not a matrix: {info.shape}")
        qtype = GGMLQuantizationType[info.type_name]

        def convert(raw: np.ndarray, rows: int) -> QuantWeight:
            if not requantize:
                return from_gguf(info.type_name, raw, shape=(rows, info.shape[1]), super_blocks=super_blocks)
            values = np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(rows, info.shape[1])
            return quantize_q8_0(torch.from_numpy(values))

        try:
            weight = self._by_rows(info, convert)
        except (ValueError, NotImplementedError) as exc:
            raise GGUFError(
                f"tensor {info.gguf_name!r} of {str(self.path)!r} is {info.type_name}, which radixkv cannot keep "
                f"quantized ({exc}); load it with weight_dtype='float'"
            ) from exc
        if info.permute_heads is not None:
            weight = weight.rows(torch.from_numpy(row_permutation(info.shape[0], info.permute_heads)))
        return weight

    def _by_rows(self, info: GGUFTensor, convert: Callable[[np.ndarray, int], QuantWeight]) -> QuantWeight:
        """convert over slices of rows, written into one result: a requantized 128k-row
        embedding would otherwise hold fp32 temporaries several times its own size."""
        from radixkv.cpu.quant import QuantWeight

        out_features, in_features = info.shape
        step = max(1, _CONVERT_VALUES // in_features)
        result: QuantWeight | None = None
        for start in range(0, out_features, step):
            stop = min(start + step, out_features)
            part = convert(self.raw(info.name, (start, stop)), stop - start)
            if stop - start == out_features:
                return part
            if result is None:  # the whole weight, in the first slice's format and dtypes
                mins = None if part.mins is None else torch.empty((out_features, *part.mins.shape[1:]), dtype=part.mins.dtype)
                result = QuantWeight(
                    part.format, out_features, in_features,
                    torch.empty((out_features, *part.quants.shape[1:]), dtype=part.quants.dtype),
                    torch.empty((out_features, *part.scales.shape[1:]), dtype=part.scales.dtype), mins,
                )  # fmt: skip
            assert part.format == result.format and part.scales.dtype == result.scales.dtype
            result.quants[start:stop] = part.quants
            result.scales[start:stop] = part.scales
            if result.mins is not None:
                result.mins[start:stop] = part.mins
        assert result is not None
        return result


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """transformers' name for a Llama-family (or Gemma 3) GGUF tensor name, None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    names = {"gemma3": _GEMMA_BLOCK_NAMES, "gpt-oss": _GPT_OSS_BLOCK_NAMES}.get(architecture, _BLOCK_NAMES)
    match = _BLOCK.match(gguf_name)
    if architecture == "gpt-oss" and match is not None and match.group(2) == "attn_sinks":
        return f"model.layers.{match.group(1)}.self_attn.sinks"
    if match is None or match.group(2) not in names:
        return None
    part = names[match.group(2)]
    if part.startswith("mlp.experts."):  # the stacked experts' biases (their weights are mapped)
        return f"model.layers.{match.group(1)}.{part}_bias" if match.group(3) == "bias" else None
    return f"model.layers.{match.group(1)}.{part}.{match.group(3)}"


def dequantize_rows(type_name: str, blocks: np.ndarray, width: int) -> Tensor:
    """Rows of a quantized matrix [rows, row bytes] as fp32 [rows, width]: MXFP4 in torch (the
    values gguf-py's dequantize gives, bit for bit), other types through gguf-py."""
    if type_name != "MXFP4":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(np.asarray(blocks), GGMLQuantizationType[type_name])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1, width))
    return dequantize_mxfp4(blocks, width)


def read_scalars(path: str | Path) -> dict[str, int | float | bool]:
    """A GGUF's numeric metadata by key (e.g. qwen3moe.expert_feed_forward_length), header only."""
    return _read_header(Path(path)).scalars


def expert_tensors(raw: GGUFTensor) -> list[GGUFTensor]:
    """A stacked experts tensor (blk.N.ffn_{gate,up,down}_exps.weight, [experts, rows, inputs])
    as one 2-D tensor per expert, model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, each
    over its own bytes of the file (expert E's blocks start E * its size in): read, dequantized or
    kept quantized one expert at a time."""
    match = _BLOCK.match(raw.gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES or match.group(3) != "weight" or len(raw.shape) != 3:
        raise GGUFError(f"tensor {raw.gguf_name!r} is no stacked experts tensor [experts, rows, inputs]: {raw.shape}")
    num_experts, shape = raw.shape[0], raw.shape[1:]
    expert_bytes = raw.nbytes // num_experts
    prefix = f"model.layers.{match.group(1)}.mlp.experts"
    return [
        replace(
            raw, name=f"{prefix}.{e}.{_EXPERT_NAMES[match.group(2)]}.weight", shape=shape, byte_shape=raw.byte_shape[1:],
            offset=raw.offset + e * expert_bytes, nbytes=expert_bytes, permute_heads=None,
        )  # fmt: skip
        for e in range(num_experts)
    ]


def row_permutation(rows: int, heads: int) -> np.ndarray:
    """Row indices undoing llama.cpp's q/k permutation: out[i] = w[index[i]], the rows
    transformers' _reverse_permute_weights produces (per head, interleaved halves to split halves)."""
    dim = rows // heads // 2
    assert heads * dim * 2 == rows, "q/k rows split evenly into heads of two halves"
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)


@dataclass(slots=True)
class _Header:
    architecture: str
    tensors: list[GGUFTensor]  # under the file's names
    scalars: dict[str, int | float | bool]  # the metadata's numbers and flags (no strings, no arrays)


# GGUF metadata value types: struct formats of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Little-endian reads from a buffered file, for the GGUF header."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file, self.path = file, path

    def take(self, count: int) -> bytes:
        data = self.file.read(count)
        if len(data) != count:
            raise GGUFError(f"{str(self.path)!r} ends inside its header (truncated?)")
        return data

    def unpack(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(int(self.unpack("<Q"))).decode("utf-8")

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        raise GGUFError(f"{str(self.path)!r} has a metadata value of unknown type {kind}")

    def skip(self, kind: int) -> None:
        """Skip a value without building it: a tokenizer's arrays hold 10^5 strings."""
        if kind in _SCALARS:
            self.file.seek(struct.calcsize(_SCALARS[kind]), 1)
        elif kind == _STRING:
            self.file.seek(int(self.unpack("<Q")), 1)
        elif kind == _ARRAY:
            item, count = int(self.unpack("<I")), int(self.unpack("<Q"))
            if item in _SCALARS:
                self.file.seek(count * struct.calcsize(_SCALARS[item]), 1)
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise GGUFError(f"{str(self.path)!r} has a metadata value of unknown type {kind}")


def _read_header(path: Path) -> _Header:
    """The architecture and tensor table of a GGUF (v2/v3), read without gguf.GGUFReader, which
    builds an object for every token of the vocabulary."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file:
        cursor = _Cursor(file, path)
        if cursor.take(4) != b"GGUF":
            raise GGUFError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{str(path)!r} is GGUF version {version}; radixkv reads versions 2 and 3")
        num_tensors, num_fields = int(cursor.unpack("<Q")), int(cursor.unpack("<Q"))
        architecture, alignment = None, _DEFAULT_ALIGNMENT
        scalars: dict[str, int | float | bool] = {}
        for _ in range(num_fields):
            key, kind = cursor.string(), int(cursor.unpack("<I"))
            if kind in _SCALARS and key != "general.alignment":
                scalars[key] = cursor.unpack(_SCALARS[kind])
            elif key in ("general.architecture", "general.alignment"):
                value = cursor.value(kind)
                if key == "general.architecture":
                    architecture = str(value)
                else:
                    alignment = int(value)  # type: ignore[arg-type]
            else:
                cursor.skip(kind)
        if architecture is None:
            raise GGUFError(f"{str(path)!r} has no general.architecture")
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [int(cursor.unpack("<Q")) for _ in range(int(cursor.unpack("<I")))]
            type_id, offset = int(cursor.unpack("<I")), int(cursor.unpack("<Q"))
            infos.append((name, dims, type_id, offset))
        start = -(-file.tell() // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"tensor {name!r} of {str(path)!r} has unknown ggml type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))  # GGUF lists the fastest-moving dimension first
        if shape[-1] % block:
            raise GGUFError(f"tensor {name!r} of {str(path)!r}: {shape[-1]} values a row is no whole number of {qtype.name} blocks")
        row_bytes = shape[-1] // block * type_size
        byte_shape = shape if qtype.name in ("F32", "F16") else (*shape[:-1], row_bytes)
        nbytes = row_bytes * math.prod(shape[:-1])
        tensors.append(GGUFTensor(name, name, qtype.name, shape, byte_shape, start + offset, nbytes, None))
    return _Header(architecture, tensors, scalars)
