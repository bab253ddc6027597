"""A test-size harmony tokenizer: a small byte-level BPE with gpt-oss's marker tokens as special
tokens and gpt-oss's own chat template, the one OpenAI ships with the model.

`gpt_oss_chat_template.jinja` beside this file is that template as published with openai/gpt-oss-120b
(the copy llama.cpp vendors as models/templates/openai-gpt-oss-120b.jinja), unmodified.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixkv.prompts.harmony import MARKERS
from tests.helpers.tiny_models import CORPUS, save_random_model

TEMPLATE = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text()
# Id 0 is the end of text, the tiny configs' eos (tests/helpers/tiny_models.py TINY_SHAPE).
SPECIALS = ["<|endoftext|>", *MARKERS]
HARMONY_CORPUS = [
    "analysis commentary final functions.get_weather to=functions.get_time json",
    '{"city": "Paris", "unit": "celsius"} {"zone": "UTC"}',
    "The user asks about the weather. We should call the tool. It is sunny in Paris.",
]


def harmony_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator((CORPUS + HARMONY_CORPUS) * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|return|>", pad_token="<|endoftext|>", additional_special_tokens=list(MARKERS)
    )
    fast.chat_template = TEMPLATE
    return fast


def scripted_gpt_oss(path: Path, reply: list[str]) -> Path:
    """A test-size gpt-oss (the harmony tokenizer's) whose greedy reply to any chat prompt is
    `reply`, one token of the tokenizer per piece, after which it goes on as after the prompt:
    every layer's weights are zero, so each layer adds nothing and the next token is a function
    of the current one alone; the reply's tokens (and the prompt's last) get orthonormal
    embeddings and the output head maps each to the next. A real model all the same: every
    route runs it as any other."""
    tokenizer = harmony_tokenizer()
    last = tokenizer("<|start|>assistant", add_special_tokens=False).input_ids[-1]  # what a generation prompt ends with
    chain = [last]
    for piece in reply:
        ids = tokenizer(piece, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"{piece!r} is not one token"
        chain += ids
    assert len(set(chain)) == len(chain), "a token twice would make its successor ambiguous"
    embedding: list[torch.Tensor] = []

    def init(name: str, param: torch.nn.Parameter) -> None:
        if name.endswith("embed_tokens.weight"):
            param.normal_(0.0, 1.0)
            basis, _ = torch.linalg.qr(torch.randn(param.shape[1], param.shape[1]))
            param[chain] = basis[: len(chain)]
            embedding.append(param.detach().clone())
        elif name.endswith("lm_head.weight"):
            param.zero_()
            rows = embedding[0] / embedding[0].pow(2).mean(-1, keepdim=True).sqrt()  # what the final norm gives
            for token, after in zip(chain, chain[1:] + chain[:1]):
                param[after] += rows[token]
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()

    save_random_model(path, "gpt_oss", 0, init, max_position_embeddings=2048, tie_word_embeddings=False)
    tokenizer.save_pretrained(path)
    return path
