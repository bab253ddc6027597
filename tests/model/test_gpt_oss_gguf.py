"""gpt-oss from a GGUF with MXFP4 experts (ggml type 39): the blocks dequantized in torch as gguf-py
does, bit for bit; the experts read in place from the file; greedy tokens equal transformers'
generate over the same model with its experts dequantized to fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from radixkv import SamplingParams
from radixkv.model.gguf import GGUFFile, dequantize_rows
from radixkv.model.gpt_oss import MappedMxfp4Experts
from tests.helpers.engine import assert_pages_returned, hf_greedy, make_llm, shared_prefix_prompts
from tests.helpers.gguf_files import GPT_OSS_SHAPE, VOCAB, write_tiny_gpt_oss_gguf

MAX_NEW = 12


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_mxfp4_dequantizes_as_gguf_py_bit_for_bit():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(6, 4 * 17), dtype=np.uint8)
    blocks[0, 0], blocks[1, 0], blocks[2, 0] = 0, 1, 255  # the subnormal scales and the largest
    expected = dequantize(blocks, GGMLQuantizationType.MXFP4).reshape(6, 128)
    ours = dequantize_rows("MXFP4", blocks, 128).numpy()
    assert np.array_equal(ours, expected)  # infinities where the scale overflows, as ggml's


@pytest.fixture(scope="module")
def gpt_oss_files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the GGUF, transformers' folder of its dequantized weights, a converted-folder cache)."""
    root = tmp_path_factory.mktemp("tiny-gpt-oss-gguf")
    return write_tiny_gpt_oss_gguf(root / "tiny-gpt-oss.gguf", root / "hf"), root / "hf", root / "cache"


def test_gguf_lists_mxfp4_experts_their_biases_and_sinks(gpt_oss_files):
    gguf, _, _ = gpt_oss_files
    file = GGUFFile(gguf, 4, 2)
    hidden, width, experts = GPT_OSS_SHAPE["hidden_size"], GPT_OSS_SHAPE["intermediate_size"], GPT_OSS_SHAPE["num_local_experts"]
    gate = file.stacked[("model.layers.0.mlp.experts", "gate_proj")]
    assert gate.type_name == "MXFP4" and gate.shape == (experts, width, hidden)
    assert file.tensors["model.layers.0.mlp.experts.gate_bias"].shape == (experts, width)
    assert file.tensors["model.layers.3.mlp.experts.down_bias"].shape == (experts, hidden)
    assert file.tensors["model.layers.1.self_attn.sinks"].shape == (4,)
    assert file.tensors["model.layers.2.mlp.router.bias"].shape == (experts,)


@pytest.mark.parametrize("moe_kernel", ["native", "torch"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_mxfp4_experts_in_place_equal_the_dequantized_forward(gpt_oss_files, cache, moe_kernel):
    """The experts grouped through csrc/moe_mxfp4.c ("native") or dequantized by torch per expert."""
    gguf, folder, cache_dir = gpt_oss_files
    prompts = shared_prefix_prompts(5, vocab=VOCAB)
    expected = hf_greedy(folder, prompts, MAX_NEW)
    llm = make_llm(gguf, attention_backend="cpu", enable_prefix_caching=cache, cache_dir=str(cache_dir), moe_kernel=moe_kernel)
    experts = [m for m in llm.engine.loaded.model.modules() if isinstance(m, MappedMxfp4Experts)]
    assert experts and all(m.grouped_ready == (moe_kernel == "native") for m in experts)
    params = SamplingParams(max_tokens=MAX_NEW)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    warm = llm.generate(prompts, params)
    assert [o.token_ids for o in warm] == expected
    if cache:
        assert all(o.num_cached_tokens > 8 for o in warm)
    assert_pages_returned(llm.engine)


def test_mxfp4_experts_are_mapped_not_copied(gpt_oss_files):
    from radixkv.attention.torch_backend import TorchBackend
    from radixkv.model import load_model

    gguf, _, cache_dir = gpt_oss_files
    loaded = load_model(str(gguf), TorchBackend(), dtype="float32", device="cpu", cache_dir=str(cache_dir))
    experts = [m for m in loaded.model.modules() if isinstance(m, MappedMxfp4Experts)]
    assert len(experts) == GPT_OSS_SHAPE["num_hidden_layers"]
    assert all(isinstance(m.gate_blocks, np.memmap) or isinstance(m.gate_blocks.base, np.memmap) for m in experts)
    file = GGUFFile(gguf, 4, 2)
    stacked = sum(t.nbytes for t in file.stacked.values())
    assert loaded.mapped_bytes == stacked == sum(m.mapped_bytes for m in experts)
    assert not any(p.numel() > 64 * 64 * 8 for name, p in loaded.model.named_parameters() if ".experts." in name), (
        "no expert matrix was copied into a parameter"
    )
    torch.testing.assert_close(experts[0].gate_bias, file.dequantized("model.layers.0.mlp.experts.gate_bias"))


def test_q8_0_matrices_beside_mxfp4_experts(tmp_path):
    """q/k/v/o (with their biases), embedding and output in Q8_0: dequantized (weight_dtype
    "float") they give transformers' tokens; kept quantized ("auto", int8 activations) the
    prefix cache on and off give the same tokens as each other."""
    gguf = write_tiny_gpt_oss_gguf(tmp_path / "q8.gguf", tmp_path / "hf", matrices="Q8_0")
    prompts = shared_prefix_prompts(5, vocab=VOCAB)
    params = SamplingParams(max_tokens=MAX_NEW)
    cache_dir = str(tmp_path / "cache")
    floats = make_llm(gguf, attention_backend="cpu", weight_dtype="float", cache_dir=cache_dir)
    assert [o.token_ids for o in floats.generate(prompts, params)] == hf_greedy(tmp_path / "hf", prompts, MAX_NEW)
    kept = [
        [o.token_ids for o in make_llm(gguf, weight_dtype="auto", cache_dir=cache_dir, enable_prefix_caching=cache).generate(prompts, params)]
        for cache in (True, False)
    ]
    assert kept[0] == kept[1]



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_experts_match_the_per_expert_path(gpt_oss_files, dtype):
    """A layer's routed pairs through the kernel (each compiled path, the same bits) against the
    torch path's dequantize-and-multiply per expert: equal within fp32's summation error (bf16:
    its rounding of gate, up and the output)."""
    from radixkv.cpu.mxfp4 import compiled_kernels
    from radixkv.model.gpt_oss import clamped_swiglu
    from radixkv.model.moe import group_by_expert

    gguf, _, _ = gpt_oss_files
    file = GGUFFile(gguf, 4, 2)
    prefix = "model.layers.1.mlp.experts"
    parts = [file.stacked[(prefix, f"{part}_proj")] for part in ("gate", "up", "down")]
    biases = [file.dequantized(f"{prefix}.{part}_bias") for part in ("gate", "up", "down")]
    hidden, size = GPT_OSS_SHAPE["hidden_size"], GPT_OSS_SHAPE["intermediate_size"]
    experts = MappedMxfp4Experts([(p.type_name, file.mapped(p)) for p in parts], biases, hidden, size, "native")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, hidden, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(GPT_OSS_SHAPE["num_local_experts"], generator=generator)[:2] for _ in range(6)])
    groups = group_by_expert(ids, torch.ones(6, 2, dtype=dtype))
    per_expert = []
    for g, expert in enumerate(groups.experts):
        rows = x[groups.tokens[groups.offsets[g] : groups.offsets[g + 1]]]
        gate, up = experts.gate_up(expert, rows)
        per_expert.append(experts.down(expert, clamped_swiglu(gate, up, 1.702, 7.0)))
    outs = []
    for kernel in compiled_kernels():
        experts.mxfp4_kernel = kernel
        outs.append(experts.grouped(x, groups, 1.702, 7.0))
    assert all(torch.equal(out, outs[0]) for out in outs)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0], torch.cat(per_expert), **tolerance)
