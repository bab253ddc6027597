"""A request's stop strings on a harmony model, through the real server and the official
clients: a test-size gpt-oss scripted to write a known reply (tests/helpers/harmony.py
scripted_gpt_oss) has its final answer cut where a plain reply would be, whole and streamed, with
finish reason "stop" (Anthropic's "stop_sequence" naming it), while the same string in the
headers or the reasoning ends nothing; the ids generated are the unstopped reply's, cut short."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from radixkv.config import EngineConfig
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.engine.sampling_params import SamplingParams
from radixkv.llm import LLM
from tests.helpers.harmony import scripted_gpt_oss
from tests.helpers.live_server import KEY_A, MODEL, LiveServer, serve

ANSWER = "The quick brown fox jumps over the lazy dog."
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
FINAL = ["<|channel|>", "f", "in", "al", "<|message|>", *WORDS, "<|return|>"]  # final answer, done
# Reasoning that never ends: analysis, then another analysis message, until max_tokens.
ANALYSIS = ["<|channel|>", "an", "al", "y", "s", "is", "<|message|>", *WORDS, "<|end|>", "<|start|>"]
MESSAGES = [{"role": "user", "content": "Say the sentence."}]


def _serve(folder) -> Iterator[LiveServer]:
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", device="cpu", page_size=4, num_pages=512, check_invariants=True))
    with serve(AsyncEngine(engine)) as live:
        yield live


@pytest.fixture(scope="module")
def final_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _serve(scripted_gpt_oss(tmp_path_factory.mktemp("scripted-final"), FINAL))


@pytest.fixture(scope="module")
def analysis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _serve(scripted_gpt_oss(tmp_path_factory.mktemp("scripted-analysis"), ANALYSIS))


def _chat(live: LiveServer, stop: list[str] | None, max_tokens: int = 32) -> tuple[str | None, str | None, str, int]:
    """(content, reasoning, finish_reason, completion_tokens) whole; the streamed reply must agree."""
    client = live.client()
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stop=stop)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    reasoning = getattr(choice.message, "reasoning_content", None)
    content, streamed_reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            streamed_reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert (content, streamed_reasoning, finish) == (choice.message.content or "", reasoning or "", choice.finish_reason)
    return choice.message.content, reasoning, choice.finish_reason, whole.usage.completion_tokens


@pytest.mark.parametrize(
    ("stop", "content", "tokens"),
    [
        (None, ANSWER, len(FINAL)),
        (["jumps"], "The quick brown fox ", 10),  # ends on the token that completes it
        (["k brown fox j", "zzz"], "The quic", 10),  # one spread over tokens, held back until decided
        (["final", "assistant"], ANSWER, len(FINAL)),  # the header's words are not the answer
    ],
)
def test_chat_cuts_the_final_answer_at_a_stop_string_whole_and_streamed(
    final_server: LiveServer, stop: list[str] | None, content: str, tokens: int
) -> None:
    assert _chat(final_server, stop) == (content, None, "stop", tokens)
    final_server.assert_idle_and_consistent()


def test_a_stop_string_in_the_reasoning_ends_nothing(analysis_server: LiveServer) -> None:
    """The reasoning repeats the sentence: "jumps" in it does not end the reply, which runs to
    max_tokens with its reasoning whole (OpenAI's stop cuts the returned text, not reasoning)."""
    content, reasoning, finish, tokens = _chat(analysis_server, ["jumps"], max_tokens=40)
    assert (content or "", finish, tokens) == ("", "length", 40)
    assert reasoning is not None and reasoning.startswith(ANSWER + ANSWER)
    analysis_server.assert_idle_and_consistent()


def test_messages_cut_at_a_stop_sequence_and_name_it_whole_and_streamed(final_server: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=final_server.base_url, api_key=KEY_A, max_retries=0, timeout=120)
    args = dict(model=MODEL, max_tokens=32, messages=MESSAGES, stop_sequences=["zzz", "jumps"])
    message = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    for reply in (message, streamed):
        assert [(b.type, b.text) for b in reply.content] == [("text", "The quick brown fox ")]
        assert (reply.stop_reason, reply.stop_sequence, reply.usage.output_tokens) == ("stop_sequence", "jumps", 10)
    plain = claude.messages.create(**{**args, "stop_sequences": ["final"]})
    assert ([b.text for b in plain.content], plain.stop_reason, plain.stop_sequence) == ([ANSWER], "end_turn", None)
    final_server.assert_idle_and_consistent()


def test_the_ids_are_the_unstopped_replys_cut_short(final_server: LiveServer) -> None:
    """Exactness: a stop string changes only where the reply ends, never what was generated."""
    prompt = final_server.async_engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    whole = final_server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=0)
    cut = final_server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0, stop=["jumps"], logprobs=True)
    cut_tokens = [t.token for t in cut.choices[0].logprobs.content]
    assert cut_tokens == whole.choices[0].logprobs.tokens[: len(cut_tokens)] and len(cut_tokens) == 10


def test_llm_chat_cuts_the_final_answer_too(tmp_path) -> None:
    llm = LLM(str(scripted_gpt_oss(tmp_path / "final", FINAL)), dtype="float32", device="cpu", page_size=4, num_pages=128)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=32, stop=["jumps"]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_string, len(out.token_ids)) == ("The quick brown fox ", "stop", "jumps", 10)
    assert llm.chat(MESSAGES, SamplingParams(max_tokens=32, stop=["final"]))[0].outputs[0].text == ANSWER
    llm.engine.close()
