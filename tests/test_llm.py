"""`LLM.chat` over a test-size gpt-oss with a harmony tokenizer: a reply comes back as its
content in `text` and its analysis in `reasoning`, read from the ids; other models' replies and a
reply that is not harmony keep the engine's text."""

from __future__ import annotations

from pathlib import Path

from radixkv import LLM, SamplingParams
from radixkv.engine.request_output import CompletionOutput, RequestOutput
from radixkv.prompts.harmony import harmony_tokens, split_reply
from tests.helpers.harmony import harmony_tokenizer
from tests.helpers.tiny_models import make_tiny_model


def test_a_harmony_chat_reply_comes_back_split_by_channel(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny-gpt-oss", "gpt_oss", max_position_embeddings=2048)
    tokenizer = harmony_tokenizer()
    tokenizer.save_pretrained(folder)  # replaces the tiny tokenizer: same vocabulary size
    llm = LLM(str(folder), dtype="float32", device="cpu", page_size=4, num_pages=256)
    marks = harmony_tokens(llm.tokenizer)
    assert marks is not None
    # A random model writes no chosen sequence: whatever it wrote comes back as split_reply reads it.
    out = llm.chat([{"role": "user", "content": "Weather in Paris?"}], SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    split = split_reply(llm.tokenizer, marks, out.token_ids)
    if split is not None:
        assert (out.text, out.reasoning) == (split[0], split[1] or None)
    else:
        assert out.reasoning is None
    # A known reply through the same path: the engine's text runs the channels together.
    reply = tokenizer("<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
                      add_special_tokens=False).input_ids  # fmt: skip
    engine_text = tokenizer.decode(reply, skip_special_tokens=True)
    known = RequestOutput("r", [1], [CompletionOutput(0, engine_text, reply, "stop")], 1, 0, None, None)
    llm._split_channels(known)
    assert (known.outputs[0].text, known.outputs[0].reasoning) == ("Sunny.", "The user asks.")
    llm.engine.close()
