"""A test-size harmony tokenizer: a small byte-level BPE with gpt-oss's marker tokens as special
tokens and gpt-oss's own chat template, the one OpenAI ships with the model.

`gpt_oss_chat_template.jinja` beside this file is that template as published with openai/gpt-oss-120b
(the copy llama.cpp vendors as models/templates/openai-gpt-oss-120b.jinja), unmodified.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixkv.prompts.harmony import MARKERS
from tests.helpers.tiny_models import CORPUS

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
