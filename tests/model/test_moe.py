"""Qwen3-MoE (radixkv.model.moe): routing as transformers routes, a step's tokens grouped by
expert so each routed expert runs once and an unrouted one never, greedy tokens equal to
transformers' generate with the prefix cache on and off, and experts kept quantized: int8 from an
HF folder, a GGUF's stacked blocks one expert at a time."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from radixkv.attention.torch_backend import TorchBackend
from radixkv.cpu.quant_linear import QuantLinear
from radixkv.engine.sampling_params import SamplingParams
from radixkv.model import load_model, load_model_config
from radixkv.model import llama
from radixkv.model.gguf import GGUFFile
from radixkv.model.moe import (
    FloatExperts, MappedExperts, MoEConfig, QuantExperts, SparseMoE, group_by_expert, route,
)  # fmt: skip
from tests.helpers.engine import hf_greedy, make_llm, shared_prefix_prompts
from tests.helpers.gguf_files import MOE_NARROW, VOCAB, write_tiny_moe_gguf
from tests.helpers.model import Stepper, make_random_model, reference_logits
from tests.helpers.tiny_models import tiny_config

SEQUENCE = [(37 * i) % 1000 + 20 for i in range(33)]
# max |quantized - float| of a layer's expert block, over max |float|, with the routing held
# fixed (int8 activations per 32 for Q8_0, per 256 for Q4_K/Q6_K). Measured on these files
# (layers 0, 1): Q8_0 0.015, 0.013; Q4_K_M 0.018, 0.015 (0.013, 0.011 with activations per 32).
# Over the whole model, routing is discrete: where int8 activations move a router's top-2 the
# logits move by a whole expert. On SEQUENCE, auto against float: Q8_0 argmax equal at 29 of 33
# positions, max |diff| / max |logit| median 0.031, worst 0.75 (a flipped expert); Q4_K_M 32 of
# 33, median 0.009, worst 0.019 (per 32: 33 of 33, median 0.008, worst 0.020).
EXPERT_BOUND = {"Q8_0": 0.03, "Q4_K_M": 0.03}


def test_sparse_layers_as_transformers_builds_them():
    config = tiny_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    hf = AutoModelForCausalLM.from_config(config)
    sparse = tuple(i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock")
    assert MoEConfig.from_hf(config, 6).moe_layers == sparse == (1, 5)
    ours = llama.ModelConfig.from_hf(config)
    assert ours.qk_norm and ours.moe is not None and ours.moe.num_experts_per_tok == 2


def _block(seed: int = 0, hidden: int = 64, experts: int = 8, width: int = 32) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(hidden, MoEConfig(experts, 2, width, True, (0,)), native=False)
    with torch.no_grad():
        moe.gate.weight.normal_(0.0, 0.3)
        moe.experts.gate_up.normal_(0.0, 0.15)
        moe.experts.down.normal_(0.0, 0.15)
    return moe


def _naive(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: sum_j w[t, j] * down(silu(gate x_t) * up x_t) of expert ids[t, j]."""
    experts: FloatExperts = moe.experts
    size, hidden = experts.intermediate_size, experts.hidden_size
    gate_up = experts.gate_up.view(experts.num_experts, 2 * size, hidden)
    down = experts.down.view(experts.num_experts, hidden, size)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, down[e])
    return out


def test_route_is_transformers_router():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    moe, x = _block(), torch.randn(11, 64)
    hf = Qwen3MoeTopKRouter(tiny_config("qwen3_moe", hidden_size=64))
    hf.weight.data.copy_(moe.gate.weight)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = route(moe.gate(x), 2, True, x.dtype)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    unnormalized, _ = route(moe.gate(x), 2, False, x.dtype)
    assert (unnormalized.sum(-1) < 1).all() and torch.allclose(weights.sum(-1), torch.ones(11))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_route_in_a_narrow_dtype_has_transformers_bits(dtype):
    """route in bf16, fp16 and fp32 has transformers' router's bits (softmax in fp32, top-k,
    divided in fp32, then cast), a token at a time (a decode step) and many at once."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf = Qwen3MoeTopKRouter(tiny_config("qwen3_moe", hidden_size=64, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True))
    generator = torch.Generator().manual_seed(3)
    hf.weight.data.copy_(torch.randn(128, 64, generator=generator))
    hf.to(dtype)
    for scale in (0.01, 0.1, 1.0, 4.0):
        x = (torch.randn(400, 64, generator=generator) * scale).to(dtype)
        logits, hf_weights, hf_ids = hf(x)
        weights, ids = route(logits, 8, True, dtype)
        assert weights.dtype == dtype and torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights), scale
        for t in range(0, 400, 37):
            one, one_ids = route(logits[t : t + 1], 8, True, dtype)
            assert torch.equal(one, hf_weights[t : t + 1]) and torch.equal(one_ids, hf_ids[t : t + 1]), (scale, t)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_experts_equal_a_per_token_loop_and_read_each_routed_expert_once(num_tokens):
    moe = _block(seed=num_tokens)
    x = torch.randn(num_tokens, 64)
    logits = moe.gate(x)
    logits[:, 6] = float("-inf")  # expert 6 routed by no token: never to be touched
    weights, ids = route(logits, 2, True, x.dtype)
    calls: list[tuple[int, int]] = []
    run = moe.run_expert
    moe.run_expert = lambda e, block: calls.append((e, block.shape[0])) or run(e, block)
    out = moe.combine(x, group_by_expert(ids, weights))
    torch.testing.assert_close(out, _naive(moe, x, weights, ids), atol=1e-5, rtol=1e-5)
    routed = torch.bincount(ids.reshape(-1), minlength=8)
    assert calls == [(e, int(routed[e])) for e in range(8) if routed[e]]  # ascending, once each, all its tokens
    assert 6 not in [e for e, _ in calls]
    # Batch invariance splits an expert's block into GEMMs of at most 32 rows: still each expert once.
    calls.clear()
    split = moe.combine(x, group_by_expert(ids, weights), batch_invariant=True)
    torch.testing.assert_close(split, out, atol=1e-6, rtol=1e-6)
    assert sorted({e for e, _ in calls}) == [e for e in range(8) if routed[e]]


def test_block_equals_transformers_sparse_block():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe, x = _block(), torch.randn(17, 64)
    hf = Qwen3MoeSparseMoeBlock(tiny_config("qwen3_moe", hidden_size=64))
    hf.gate.weight.data.copy_(moe.gate.weight)
    hf.experts.gate_up_proj.data.copy_(moe.experts.gate_up.view(8, 64, 64))
    hf.experts.down_proj.data.copy_(moe.experts.down.view(8, 64, 32))
    with torch.no_grad():
        torch.testing.assert_close(moe(x, SimpleNamespace(batch_invariant=False)), hf(x[None])[0], atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """3 layers, the middle one dense (mlp_only_layers), every weight random."""
    return make_random_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])


def _greedy(folder: Path | str, prompts: list[list[int]], **options) -> list[list[int]]:
    llm = make_llm(folder, **options)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]


def test_greedy_tokens_equal_transformers_cache_on_and_off(moe_folder):
    prompts = shared_prefix_prompts(3)
    reference = hf_greedy(moe_folder, prompts, 8)
    assert _greedy(moe_folder, prompts) == reference
    assert _greedy(moe_folder, prompts, enable_prefix_caching=False) == reference


def test_int8_experts_cache_on_and_off_bit_identical(moe_folder):
    prompts = shared_prefix_prompts(4)
    llm = make_llm(moe_folder, weight_dtype="int8")
    model = llm.engine.loaded.model
    assert isinstance(model.layers[0].mlp.experts, QuantExperts) and not isinstance(model.layers[1].mlp, SparseMoE)
    cached = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
    assert _greedy(moe_folder, prompts, weight_dtype="int8", enable_prefix_caching=False) == cached


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-moe-ggufs")
    files: dict[str, Path] = {}

    def get(type_name: str) -> Path:
        if type_name not in files:
            files[type_name] = write_tiny_moe_gguf(folder / f"tiny-moe-{type_name}.gguf", type_name)
        return files[type_name]

    return get


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe-gguf-cache")


def _load(path: Path, weight_dtype: str, cache: Path):
    return load_model(str(path), TorchBackend(), dtype="float32", device="cpu", weight_dtype=weight_dtype, cache_dir=str(cache))


def test_gguf_experts_are_one_tensor_each_over_the_files_blocks(moe_ggufs):
    file = GGUFFile(moe_ggufs("Q4_K_M"), 4, 2)
    gate = [file.tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(8)]
    assert all(t.shape == (768, 256) and t.type_name == "Q4_K" for t in gate)
    assert [t.offset - gate[0].offset for t in gate] == [e * gate[0].nbytes for e in range(8)]
    assert file.tensors["model.layers.1.mlp.experts.7.down_proj.weight"].type_name == "Q6_K"
    assert file.tensors["model.layers.0.mlp.gate.weight"].type_name == "F32"


@pytest.mark.parametrize("type_name", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_float_equals_transformers(moe_ggufs, cache, type_name):
    path = moe_ggufs(type_name)
    logits = Stepper(_load(path, "float", cache), [SEQUENCE]).step({0: len(SEQUENCE)})[0]
    (reference,) = reference_logits(path, [SEQUENCE])
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)


def _load_kernel(path: Path, weight_dtype: str, cache: Path, moe_kernel: str):
    return load_model(
        str(path), TorchBackend(), dtype="float32", device="cpu", weight_dtype=weight_dtype, cache_dir=str(cache), moe_kernel=moe_kernel
    )


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
def test_gguf_experts_read_in_place_within_the_formats_bound(moe_ggufs, cache, type_name):
    path = moe_ggufs(type_name)
    as_float, auto = _load(path, "float", cache), _load(path, "auto", cache)
    assert auto.weight_format == "auto"
    file = GGUFFile(path, 4, 2)
    expert_bytes = sum(t.nbytes for t in file.stacked.values())
    assert auto.mapped_bytes == expert_bytes and as_float.mapped_bytes == 0
    torch.manual_seed(1)
    x = torch.randn(24, 256)
    for layer in range(2):
        dense, mapped = as_float.model.layers[layer].mlp, auto.model.layers[layer].mlp
        experts = mapped.experts
        assert isinstance(experts, MappedExperts) and experts.kernel == "native"
        # The file's own bytes: views of its memory map, not copies.
        assert isinstance(experts.gate.base, np.memmap) or isinstance(getattr(experts.gate.base, "base", None), np.memmap)
        types = {experts.gate_type, experts.down_type}
        assert types == ({"Q8_0"} if type_name == "Q8_0" else {"Q4_K", "Q6_K"})  # Q4_K_M's down experts: Q6_K
        weights, ids = route(dense.gate(x), 2, True, x.dtype)  # one routing for both
        groups = group_by_expert(ids, weights)
        want, got = dense.combine(x, groups), mapped.combine(x, groups)
        assert (got - want).abs().max() / want.abs().max() <= EXPERT_BOUND[type_name]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K_M"])
def test_native_experts_equal_the_torch_reference_bit_for_bit(moe_ggufs, cache, type_name):
    path = moe_ggufs(type_name)
    native_loaded, torch_loaded = _load_kernel(path, "auto", cache, "native"), _load_kernel(path, "auto", cache, "torch")
    assert torch_loaded.model.layers[0].mlp.experts.kernel == "torch"
    sequences = [SEQUENCE, SEQUENCE[:9]]
    native_logits = Stepper(native_loaded, sequences).step({0: 33, 1: 9})
    torch_logits = Stepper(torch_loaded, sequences).step({0: 33, 1: 9})
    assert native_logits.keys() == torch_logits.keys() == {0, 1}
    for seq in (0, 1):
        assert torch.equal(native_logits[seq], torch_logits[seq])


def test_native_fp32_float_experts_greedy_equals_transformers(moe_ggufs, cache):
    path = moe_ggufs("Q8_0")
    prompts = shared_prefix_prompts(6, vocab=VOCAB, count=3)
    reference = hf_greedy(path, prompts, 8)
    options = dict(cache_dir=str(cache), weight_dtype="float", dtype="float32", moe_kernel="native_fp32")
    llm = make_llm(path, **options)
    experts = llm.engine.loaded.model.layers[0].mlp.experts
    assert isinstance(experts, FloatExperts) and experts.grouped_ready
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))] == reference


def test_moe_kernel_is_checked():
    from radixkv.config import EngineConfig
    from radixkv.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        EngineConfig(moe_kernel="fast")
    assert error.value.param == "moe_kernel"


def test_gguf_quantized_experts_cache_on_and_off_bit_identical(moe_ggufs, cache):
    path = moe_ggufs("Q4_K_M")
    prompts = shared_prefix_prompts(5, vocab=VOCAB, count=4)
    on = _greedy(path, prompts, cache_dir=str(cache))
    assert _greedy(path, prompts, cache_dir=str(cache), enable_prefix_caching=False) == on


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_one_sequence_decode_native_equals_the_torch_reference(moe_ggufs, cache, dtype):
    """One sequence: every decode step is one token, so native runs the one-token calls and the
    torch reference the grouped path; the greedy tokens agree."""
    path = moe_ggufs("Q4_K_M")
    prompts = shared_prefix_prompts(5, vocab=VOCAB, count=1)
    native = _greedy(path, prompts, cache_dir=str(cache), dtype=dtype, moe_kernel="native")
    assert native == _greedy(path, prompts, cache_dir=str(cache), dtype=dtype, moe_kernel="torch")


def test_gguf_expert_width_is_read_from_the_file(tmp_path, cache):
    path = write_tiny_moe_gguf(tmp_path / "narrow.gguf", "Q8_0", moe_intermediate_size=MOE_NARROW)
    assert load_model_config(str(path), str(cache)).moe.moe_intermediate_size == MOE_NARROW
    loaded = _load(path, "auto", cache)
    assert loaded.model.layers[0].mlp.experts.intermediate_size == MOE_NARROW
    logits = Stepper(loaded, [SEQUENCE]).step({0: len(SEQUENCE)})[0]
    assert torch.isfinite(logits).all()


def test_kv_sizing_leaves_the_mapped_experts_their_memory(moe_ggufs, cache):
    from radixkv.engine.build import kv_memory_bytes

    loaded = _load(moe_ggufs("Q8_0"), "auto", cache)
    assert loaded.mapped_bytes > 0
    assert kv_memory_bytes(10 * loaded.mapped_bytes, loaded) == 9 * loaded.mapped_bytes
    assert kv_memory_bytes(loaded.mapped_bytes // 2, loaded) == 0


def test_a_large_gguf_is_keyed_from_its_header_and_samples_not_read_whole(tmp_path):
    from radixkv.model import loader

    big = tmp_path / "big.gguf"
    with open(big, "wb") as file:
        file.write(b"GGUF" + bytes(100))
        file.truncate(loader._FULL_KEY_BYTES + (1 << 20))  # sparse: costs no disk
    key = loader._content_key(big)
    step = (big.stat().st_size - loader._KEY_SAMPLE_BYTES) // (loader._KEY_SAMPLES - 1)
    with open(big, "r+b") as file:
        file.seek(step + loader._KEY_SAMPLE_BYTES + 4096)  # between two samples: not read
        file.write(b"x")
    assert loader._content_key(big) == key
    with open(big, "r+b") as file:
        file.seek(64)  # in the header
        file.write(b"y")
    assert loader._content_key(big) != key


def _faults_reading(file: GGUFFile) -> tuple[int, int]:
    """(minor page faults while touching every page of the file's stacked experts, pages)."""
    import resource

    views = [file.mapped(t).reshape(-1) for t in file.stacked.values()]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for view in views:
        view[::4096].sum(dtype=np.uint64)  # one byte of each page read
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults, sum(v.nbytes for v in views) // 4096


def test_populate_maps_the_experts_pages_at_load_not_on_first_touch(moe_ggufs):
    path = moe_ggufs("Q4_K_M")
    cold, pages = _faults_reading(GGUFFile(path, 4, 2))
    populated = GGUFFile(path, 4, 2)
    for tensor in populated.stacked.values():
        populated.populate(tensor)
    warm, _ = _faults_reading(populated)
    assert pages > 200 and cold > 8  # each first touch faults (the kernel maps a few pages a fault)
    assert warm <= cold // 4


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q5_0", "Q4_1", "Q4_0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_block_equals_the_grouped_combine_bit_for_bit(types, dtype):
    """A decode step's one token takes two native calls (SparseMoE.forward's one_token path):
    the same bits as the grouped kernel's combine, VNNI and scalar, at 1, 2 and 3 threads."""
    from radixkv.cpu import native
    from tests.cpu.test_moe_kernel import random_experts

    if native.load() is None:
        pytest.skip("the native kernels did not build (no C compiler)")
    hidden, size, experts, top_k = 512, 256, 12, 4
    parts = [(types[0], random_experts(types[0], experts, size, hidden, 1)), (types[1], random_experts(types[1], experts, size, hidden, 2)),
             (types[2], random_experts(types[2], experts, hidden, size, 3))]  # fmt: skip
    block = SparseMoE(hidden, MoEConfig(experts, top_k, size, True, (0,)))
    block.experts = MappedExperts(parts, hidden, size, "native")
    before = torch.get_num_threads()
    try:
        for seed, (vnni, threads) in enumerate([(True, 1), (True, 2), (True, 3), (False, 1), (False, 2)]):
            block.experts.vnni = vnni
            torch.set_num_threads(threads)
            x = (torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
            weights, ids = route(torch.randn(1, experts, generator=torch.Generator().manual_seed(seed + 9)), top_k, True, dtype)
            got = block.experts.one_token(x, ids, weights)
            assert got.dtype == dtype and torch.equal(got, block.combine(x, group_by_expert(ids, weights))), (vnni, threads)
            # Batch-invariant: the token's row in a step of three (the grouped path) has the same bits.
            others = torch.randn(2, hidden, generator=torch.Generator().manual_seed(seed + 5)).to(dtype)
            more_weights, more_ids = route(torch.randn(2, experts, generator=torch.Generator().manual_seed(seed)), top_k, True, dtype)
            batch = torch.cat([others[:1], x, others[1:]])
            groups = group_by_expert(torch.cat([more_ids[:1], ids, more_ids[1:]]), torch.cat([more_weights[:1], weights, more_weights[1:]]))
            assert torch.equal(block.combine(batch, groups)[1:2], got)
    finally:
        torch.set_num_threads(before)
    block.experts.kernel = "torch"  # the reference runs the general path
    assert block.experts.one_token(x, ids, weights) is None
