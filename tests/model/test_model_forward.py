"""Our Llama-family forward against transformers on tiny random models: whole sequences,
prefix then suffix over paged KV, and several requests mixed in one flat batch."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.model import Stepper, make_random_model, reference_logits

from radixkv.attention.cpu_backend import CPUBackend
from radixkv.attention.torch_backend import TorchBackend
from radixkv.cpu import native
from radixkv.cpu.linear import PackedLinear
from radixkv.model import load_model

ATOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that some of head_dim 16's frequencies are scaled, some smoothed, some kept.
    "original_max_position_embeddings": 32,
}
DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
CASES = {
    "llama": ("llama", {}),
    "llama_bias": ("llama", {"attention_bias": True}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama_linear_rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama_dynamic_rope": ("llama", {"rope_parameters": DYNAMIC_ROPE}),
    "llama_yarn_rope": ("llama", {"rope_parameters": YARN_ROPE}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
}


def _sequences(vocab_size: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(params=list(CASES), scope="module")
def model_case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    folder = make_random_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    loaded = load_model(str(folder), TorchBackend(), dtype="float32", device="cpu")
    return folder, loaded


def test_full_sequence(model_case):
    folder, loaded = model_case
    (sequence,) = _sequences(loaded.config.vocab_size, [23])
    (reference,) = reference_logits(folder, [sequence])
    logits = Stepper(loaded, [sequence]).step({0: len(sequence)})[0]
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prefix_len", [8, 7])  # page-aligned, and mid-page as chunked prefill leaves it
def test_prefix_then_suffix(model_case, prefix_len):
    folder, loaded = model_case
    (sequence,) = _sequences(loaded.config.vocab_size, [21])
    (reference,) = reference_logits(folder, [sequence])
    stepper = Stepper(loaded, [sequence])
    first = stepper.step({0: prefix_len})[0]
    rest = stepper.step({0: len(sequence) - prefix_len})[0]
    torch.testing.assert_close(torch.cat([first, rest]), reference, atol=ATOL, rtol=0)


def test_mixed_batch_prefill_chunks_and_decode(model_case):
    """Three requests: prefill chunks and decode tokens share steps; then decode-only steps."""
    folder, loaded = model_case
    sequences = _sequences(loaded.config.vocab_size, [19, 26, 12])
    references = reference_logits(folder, sequences)
    stepper = Stepper(loaded, sequences)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    schedule = [
        {0: 16, 1: 5},  # request 0 prefills, request 1 its first chunk
        {0: 1, 1: 11, 2: 12},  # 0 decodes, 1 continues mid-page, 2 prefills whole
        {0: 1, 1: 1, 2: 0},
    ]
    for step in schedule:
        for r, logits in stepper.step({r: n for r, n in step.items() if n}).items():
            got[r].append(logits)
    while any(stepper.num_computed[r] < len(sequences[r]) for r in got):  # decode-only steps
        step = {r: 1 for r in got if stepper.num_computed[r] < len(sequences[r])}
        for r, logits in stepper.step(step).items():
            got[r].append(logits)
    for r, reference in enumerate(references):
        torch.testing.assert_close(torch.cat(got[r]), reference, atol=ATOL, rtol=0)


def test_last_token_logits_only(model_case):
    """Default use: one row per request, the last new token's."""
    folder, loaded = model_case
    sequences = _sequences(loaded.config.vocab_size, [9, 14])
    references = reference_logits(folder, sequences)
    out = Stepper(loaded, sequences).step({0: 9, 1: 14}, all_logits=False)
    for r, reference in enumerate(references):
        assert out[r].shape == (1, loaded.config.vocab_size) and out[r].dtype == torch.float32
        torch.testing.assert_close(out[r][0], reference[-1], atol=ATOL, rtol=0)


def test_weights_are_fused_frozen_and_tied(model_case):
    _, loaded = model_case
    model, config = loaded.model, loaded.config
    attn = model.layers[0].self_attn
    qkv_rows = (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
    assert (attn.qkv_proj.out_features, attn.qkv_proj.in_features) == (qkv_rows, config.hidden_size)
    gate_up = model.layers[0].mlp.gate_up_proj
    assert (gate_up.out_features, gate_up.in_features) == (2 * config.intermediate_size, config.hidden_size)
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())
    if isinstance(model.lm_head, PackedLinear):  # packed at load (fp32 on AVX2): a copy, laid out for the product
        assert model.lm_head.out_features == model.embed_tokens.weight.shape[0]
    else:
        assert (model.lm_head.weight is model.embed_tokens.weight) == config.tie_word_embeddings


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_is_as_close_to_fp32_as_transformers_bf16(tmp_path, arch):
    folder = make_random_model(tmp_path, arch)
    sequences = _sequences(320, [24])
    (fp32,) = reference_logits(folder, sequences)
    (hf_bf16,) = reference_logits(folder, sequences, torch.bfloat16)
    loaded = load_model(str(folder), TorchBackend(), dtype="bfloat16", device="cpu")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    ours = Stepper(loaded, sequences).step({0: 24})[0]
    hf_error = (hf_bf16 - fp32).abs().max().item()
    our_error = (ours - fp32).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2, (our_error, hf_error)


# A schedule with every kind of step: prefill chunks, a mixed step, decode-only steps.
MIXED_SCHEDULE = [{0: 16, 1: 5}, {0: 1, 1: 11, 2: 12}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}]


def _scheduled_logits(folder, backend, dtype: str, native_kernels: bool) -> torch.Tensor:
    loaded = load_model(str(folder), backend, dtype=dtype, device="cpu", native_kernels=native_kernels)
    assert loaded.model.attention is backend
    torch.manual_seed(0)  # the same shuffled pages every time
    stepper = Stepper(loaded, _sequences(320, [19, 26, 14]))
    return torch.cat([step for plan in MIXED_SCHEDULE for step in stepper.step(plan).values()])


@pytest.mark.skipif(native.load() is None, reason="needs the native kernels (no C compiler here)")
@pytest.mark.parametrize(("arch", "overrides"), [("llama", {}), ("qwen2", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2})])
def test_native_kernels_match_the_torch_reference(tmp_path, arch, overrides):
    """The CPU backend with every native kernel on (paged decode, KV stores, row ops, packed
    linears) against the torch reference backend with them all off, over the same schedule."""
    folder = make_random_model(tmp_path, arch, **overrides)
    reference = _scheduled_logits(folder, TorchBackend(), "float32", native_kernels=False)
    # fp32: the kernels only sum in another order.
    fp32 = _scheduled_logits(folder, CPUBackend(), "float32", native_kernels=True)
    torch.testing.assert_close(fp32, reference, atol=ATOL, rtol=0)
    # bf16: as far from fp32 as the reference's own bf16 run is, give or take.
    native_error = (_scheduled_logits(folder, CPUBackend(), "bfloat16", native_kernels=True) - reference).abs().max().item()
    torch_error = (_scheduled_logits(folder, TorchBackend(), "bfloat16", native_kernels=False) - reference).abs().max().item()
    assert native_error <= 2 * torch_error + 1e-2, (native_error, torch_error)
