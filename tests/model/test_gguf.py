"""Reading GGUF files directly (radixkv.model.gguf) under every weight_dtype: float equals
transformers' own GGUF load, auto keeps the blocks within each format's measured bound of float,
tied weights are held once, and a file radixkv cannot read is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixkv.attention.torch_backend import TorchBackend
from radixkv.cpu.quant_linear import QuantEmbedding, QuantLinear
from radixkv.errors import ConfigError
from radixkv.model import load_model
from radixkv.model.gguf import GGUFError, GGUFFile, row_permutation
from radixkv.model.loader import GGUF_MARKER
from radixkv.model.quantized import weight_bytes
from tests.helpers.gguf_files import ALL_TYPES, FLOAT_TYPES, write_tiny_gguf
from tests.helpers.model import Stepper, reference_logits

SEQUENCE = [(37 * i) % 1000 + 20 for i in range(33)]
# max |auto - float| over the logits, as a share of max |float logits|, on the tiny random
# model: int8 activations (every quantized format) and, for Q6_K, its requantization to 8 bits.
# Measured on these files: Q8_0 0.062, Q4_0 0.079, Q4_1 0.064, Q4_K 0.0006, Q6_K 0.026, Q4_K_M 0.040 (the random
# K-quant blocks hold small weights, so activations' rounding weighs less there).
AUTO_BOUND = {"Q8_0": 0.1, "Q4_0": 0.12, "Q4_1": 0.1, "Q4_K": 0.005, "Q6_K": 0.05, "Q4_K_M": 0.05}
# Bytes the weights hold against the GGUF's tensor bytes: the repack to blocks of 32 with an fp32
# scale (and min) each. Q4_0/Q4_K: 24 bytes a block against 18; Q6_K -> q8_0: 36 against 26.25.
BYTES_FACTOR = 1.4


def _load(path: Path, weight_dtype: str, cache: Path, **options):
    return load_model(str(path), TorchBackend(), dtype="float32", device="cpu", weight_dtype=weight_dtype, cache_dir=str(cache), **options)


def _logits(loaded, sequence: list[int] = SEQUENCE) -> torch.Tensor:
    return Stepper(loaded, [sequence]).step({0: len(sequence)})[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.mark.parametrize("type_name", [*ALL_TYPES, "Q4_K_M"])
def test_float_equals_transformers_and_auto_is_within_the_formats_bound(tiny_ggufs, cache, type_name):
    path = tiny_ggufs(type_name)
    as_float = _load(path, "float", cache)
    assert not list(Path(as_float.path).glob("*.safetensors")) and (Path(as_float.path) / GGUF_MARKER).is_file()
    float_logits = _logits(as_float)
    (reference,) = reference_logits(path, [SEQUENCE])
    torch.testing.assert_close(float_logits, reference, atol=1e-3, rtol=0)  # fp32, summed in another order

    auto = _load(path, "auto", cache)
    auto_logits = _logits(auto)
    if type_name in FLOAT_TYPES:
        assert auto.weight_format == "float" and torch.equal(auto_logits, float_logits)
        return
    assert auto.weight_format == "auto"
    error = ((auto_logits - float_logits).abs().max() / float_logits.abs().max()).item()
    print(f"{type_name}: auto differs from float by {error:.4f} of the largest logit")
    assert 0 < error <= AUTO_BOUND[type_name]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K_M"])
def test_quantized_weights_are_held_once_in_about_the_files_bytes(tiny_ggufs, cache, type_name):
    path = tiny_ggufs(type_name)
    loaded = _load(path, "auto", cache)
    model = loaded.model
    # Tied: the embedding reads the lm_head's bytes, no copy of its own.
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.linear is model.lm_head and model.embed_tokens.weight_nbytes == 0
    held, stored = weight_bytes(model), GGUFFile(path, 4, 2).tensor_bytes
    print(f"{type_name}: weights hold {held} bytes, the file's tensors {stored} ({held / stored:.3f}x)")
    assert held <= stored * BYTES_FACTOR
    qkv = model.layers[0].self_attn.qkv_proj
    # Q4_K_M: Q4_K q and k beside a Q6_K v stay one linear of parts, each in its own format.
    assert isinstance(qkv, QuantLinear) and (qkv.format == "parts") == (type_name == "Q4_K_M")


def test_int8_makes_every_linear_q8_0_and_keeps_q8_0_blocks_as_they_are(tiny_ggufs, cache):
    q4k = _load(tiny_ggufs("Q4_K_M"), "int8", cache)
    linears = [m for m in q4k.model.modules() if isinstance(m, QuantLinear)]
    assert linears and {m.format for m in linears} == {"q8_0"} and q4k.weight_format == "int8"
    q8 = tiny_ggufs("Q8_0")
    torch.testing.assert_close(_logits(_load(q8, "int8", cache)), _logits(_load(q8, "auto", cache)), atol=0, rtol=0)


def test_an_hf_folder_quantized_at_load_to_int8(tiny_llama, cache):
    as_float = _load(tiny_llama, "auto", cache)
    assert as_float.weight_format == "float" and not any(isinstance(m, QuantLinear) for m in as_float.model.modules())
    int8 = _load(tiny_llama, "int8", cache)
    linears = [m for m in int8.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * 2 + 1 and int8.weight_format == "int8"  # qkv, o, gate_up, down a layer; lm_head
    sequence = [i % 300 + 10 for i in SEQUENCE]  # the tiny HF model's vocabulary is 320
    float_logits, int8_logits = _logits(as_float, sequence), _logits(int8, sequence)
    error = ((int8_logits - float_logits).abs().max() / float_logits.abs().max()).item()
    print(f"tiny HF llama: int8 differs from float by {error:.4f} of the largest logit")
    assert 0 < error <= 0.1


def test_an_untied_gguf_keeps_its_embedding_and_lm_head_apart(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "untied.gguf", "Q4_1", tied=False)
    loaded = _load(path, "auto", cache)
    assert not loaded.config.tie_word_embeddings
    assert isinstance(loaded.model.embed_tokens, QuantEmbedding) and loaded.model.embed_tokens.linear is None
    (reference,) = reference_logits(path, [SEQUENCE])
    torch.testing.assert_close(_logits(_load(path, "float", cache)), reference, atol=1e-3, rtol=0)


def test_q_and_k_rows_are_reverse_permuted_as_transformers_does():
    import numpy as np

    rows = np.arange(16 * 3).reshape(16, 3)  # 2 heads of 8 rows
    heads, dim = 2, 16 // 2 // 2
    expected = rows.reshape(heads, dim, 2, 3).swapaxes(2, 1).reshape(rows.shape)  # transformers' _reverse_permute_weights
    assert np.array_equal(rows[row_permutation(16, heads)], expected)


def test_a_truncated_or_malformed_gguf_is_a_clear_error(tiny_ggufs, tmp_path, cache):
    data = tiny_ggufs("Q8_0").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 4096])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(truncated, 4, 2)
    with pytest.raises(GGUFError):  # wherever it is found first: transformers' config read, or ours
        _load(truncated, "auto", tmp_path / "cache1")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GGUFError, match="garbage.gguf"):
        _load(garbage, "auto", tmp_path / "cache2")
    assert [p.name for p in (tmp_path / "cache2").iterdir()] == []


def test_an_unsupported_quant_type_is_named(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "iq.gguf", "Q8_0", overrides={"blk.0.ffn_up.weight": "IQ2_XS"})
    with pytest.raises(GGUFError, match="IQ2_XS") as raised:
        _load(path, "auto", cache)
    assert "blk.0.ffn_up.weight" in str(raised.value)


def test_weight_dtype_is_validated():
    from radixkv.config import EngineConfig

    with pytest.raises(ConfigError) as raised:
        EngineConfig(weight_dtype="int4")
    assert raised.value.param == "weight_dtype"
    with pytest.raises(ConfigError, match="weight_dtype"):
        load_model(None, TorchBackend(), device="cpu", weight_dtype="q4")


def test_a_llama_ggufs_folder_reads_as_transformers_auto_classes_would_without_their_imports(tiny_ggufs, cache):
    """A Llama GGUF's cache folder: its config read plain and its tokenizer by the class it names
    give what AutoConfig and AutoTokenizer give, and a load in a fresh process imports neither
    transformers.activations nor sympy (LlamaConfig's validators pull them in: ~0.06 GB)."""
    import json
    import subprocess
    import sys

    from transformers import AutoConfig, AutoTokenizer

    from radixkv.model.llama import ModelConfig
    from radixkv.model.loader import _hf_config, load_tokenizer, resolve_model_source

    path = tiny_ggufs("Q8_0")
    _load(path, "auto", cache)
    folder = resolve_model_source(str(path), str(cache)).folder
    assert (folder / GGUF_MARKER).is_file() and json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert ModelConfig.from_hf(_hf_config(folder)) == ModelConfig.from_hf(AutoConfig.from_pretrained(folder))
    plain, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    text = "Hello wörld 123\n\n\tbye"
    assert type(plain) is type(auto) and plain(text).input_ids == auto(text).input_ids
    assert plain.chat_template == auto.chat_template and plain.all_special_ids == auto.all_special_ids
    code = (
        "import sys; from radixkv.model import load_model; from radixkv.attention.torch_backend import TorchBackend;"
        f"load_model({str(path)!r}, TorchBackend(), dtype='float32', device='cpu', cache_dir={str(cache)!r});"
        "print(sorted(m for m in ('transformers.activations', 'sympy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
