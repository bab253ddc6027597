"""`LLM`: the in-process entry point — generate from prompts or chat conversations in batches.

It owns an `Engine`, encodes prompts, submits every request at once (so the scheduler can share
their prefixes), runs them to completion and returns outputs in input order. Chats continue
exactly, as over HTTP: the replies it generated are remembered (one `ReplyMap`, its single owner)
and put back as their generated ids when they come back as assistant messages. A harmony model's
chat reply (gpt-oss) comes back as its content in `text` and its analysis in `reasoning`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from radixkv.config import EngineConfig
from radixkv.engine.detokenizer import ContentStops
from radixkv.engine.engine import Engine
from radixkv.engine.keeps import check_keeps
from radixkv.engine.request import Keep
from radixkv.engine.request_output import RequestOutput
from radixkv.engine.sampling_params import SamplingParams
from radixkv.engine.run import run_to_completion
from radixkv.engine.sessions import SessionRef
from radixkv.engine.stats import EngineStats
from radixkv.errors import InvalidRequest, QueueFull
from radixkv.prompts import Message, Prompt, encode, encode_chat
from radixkv.prompts.harmony import harmony_tokens, split_reply
from radixkv.prompts.replies import DEFAULT_MAX_REPLIES, DEFAULT_MAX_REPLY_TOKENS, ReplyMap, encode_chat_exact

# What generate takes per prompt: text, token ids, or a Prompt (messages, text or token ids).
PromptLike = str | list[int] | Prompt


class LLM:
    """`exact_continuation` (on by default, as `radixkv serve`'s): a chat's earlier replies that
    this LLM generated go back into its prompt as the ids they were generated as, so the next
    turn hits the cache in full even where a reply's text re-tokenizes otherwise."""

    def __init__(self, model: str | None = None, *, exact_continuation: bool = True, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._harmony = harmony_tokens(self.tokenizer)  # gpt-oss's format: chat replies split by channel
        # In-process callers are one owner (None), as for pins and sessions.
        self.replies = ReplyMap(self.tokenizer, DEFAULT_MAX_REPLIES, DEFAULT_MAX_REPLY_TOKENS, DEFAULT_MAX_REPLY_TOKENS) if exact_continuation else None

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        salt: str | None = None,
        session: str | None = None,
        keeps: Sequence[tuple[Keep, ...]] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text, a list of token ids, or a Prompt.
        `session` names a session (engine/sessions.py): its newest turn stays retained.
        `keeps`: one tuple per prompt of what stays cached once it is computed (engine/keeps.py,
        under the pin and retention caps of in-process callers); `RequestOutput.kept` says what did."""
        listed = _as_prompt_list(prompts)
        token_lists = [self.encode_exact(p, salt=salt) for p in listed]
        if keeps is not None and len(keeps) != len(token_lists):
            raise InvalidRequest(f"got {len(keeps)} keeps tuples for {len(token_lists)} prompts", param="keeps")
        chats = [isinstance(p, Prompt) and p.token_ids is None and p.messages is not None for p in listed]
        return self._run(token_lists, _as_params_list(params, len(token_lists)), salt, session, keeps, chats)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        salt: str | None = None,
        session: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the reply; replies
        this LLM generated before go back as their ids (exact continuation)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.encode_exact(Prompt(messages=list(c)), salt=salt) for c in conversations]  # type: ignore[arg-type]
        return self._run(token_lists, _as_params_list(params, len(token_lists)), salt, session, chats=[True] * len(token_lists))

    def encode(self, prompt: PromptLike) -> list[int]:
        return encode(self.tokenizer, prompt)

    def encode_exact(self, prompt: PromptLike, *, salt: str | None = None) -> list[int]:
        """`encode`, except that a Prompt of messages puts back the replies this LLM generated in
        partition `salt` as their generated ids where that is safe (radixkv.prompts.replies)."""
        if not isinstance(prompt, Prompt) or prompt.token_ids is not None or prompt.messages is None:
            return encode(self.tokenizer, prompt)
        return encode_chat_exact(
            self.replies, None, self.tokenizer, prompt.messages, salt=salt,
            max_context_tokens=self.engine.max_context_tokens, add_generation_prompt=prompt.add_generation_prompt,
        ).token_ids  # fmt: skip

    def remember(self, output: RequestOutput, *, salt: str | None = None) -> None:
        """Keep a finished chat reply's ids (every complete choice) for the turns that send it back."""
        if self.replies is None:
            return
        for choice in output.outputs:
            if choice.finish_reason is not None and choice.finish_reason != "abort":
                self.replies.remember(None, choice.text, choice.token_ids, salt=salt)

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt)

    def close(self) -> None:
        """Write the RAM cache to the disk tier (EngineConfig.kv_disk_dir), so the next LLM on
        the same model and directory starts warm. A no-op without a disk tier."""
        self.engine.close()

    def _split_channels(self, output: RequestOutput, stop: Sequence[str] = ()) -> None:
        """A harmony model's chat reply: content in `text` (cut at a stop string as the engine
        ended it), analysis in `reasoning` (the engine's text has the markers dropped and the
        channels run together); ids left as generated."""
        if self._harmony is None:
            return
        for choice in output.outputs:
            reader = ContentStops(self.tokenizer, self._harmony, tuple(stop))
            split = split_reply(self.tokenizer, self._harmony, choice.token_ids, reader)
            if split is not None:
                choice.text, choice.reasoning = split[0], split[1] or None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run(
        self,
        token_lists: list[list[int]],
        params: list[SamplingParams],
        salt: str | None,
        session: str | None = None,
        keeps: Sequence[tuple[Keep, ...]] | None = None,
        chats: Sequence[bool] | None = None,
    ) -> list[RequestOutput]:
        # Check everything before queueing anything, so a bad prompt leaves nothing behind.
        for i, (tokens, p) in enumerate(zip(token_lists, params)):
            self.engine.check_request(tokens, p, salt)
            check_keeps(keeps[i] if keeps else (), len(tokens))
            if p.n > self.config.max_queue_len:
                raise QueueFull(f"n={p.n} is more than the waiting queue holds ({self.config.max_queue_len})", limit=self.config.max_queue_len)
        if chats is not None and self._harmony is not None:  # a chat reply's stop strings match its content
            params = [replace(p, stop_in_content=True) if chat and p.stop else p for p, chat in zip(params, chats)]
        results: list[RequestOutput | None] = [None] * len(token_lists)

        def finished(i: int, output: RequestOutput) -> None:
            results[i] = output
            if chats is not None and chats[i]:
                self.remember(output, salt=salt)
                self._split_channels(output, params[i].stop)

        ref = SessionRef(None, session) if session is not None else None  # in-process callers are one owner
        run_to_completion(self.engine, token_lists, params, salt=salt, on_finished=finished, session=ref, keeps=keeps)
        return results  # type: ignore[return-value]


def _as_prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
    if isinstance(prompts, (str, Prompt)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts  # type: ignore[return-value]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {count} prompts", param="params")
    return params
