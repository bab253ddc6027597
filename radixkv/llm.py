"""`LLM`: the in-process entry point — generate from prompts or chat conversations in batches.

It owns an `Engine`, encodes prompts, submits every request at once (so the scheduler can share
their prefixes), runs them to completion and returns outputs in input order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.config import EngineConfig
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

# What generate takes per prompt: text, token ids, or a Prompt (messages, text or token ids).
PromptLike = str | list[int] | Prompt


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer

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
        token_lists = [encode(self.tokenizer, p) for p in _as_prompt_list(prompts)]
        if keeps is not None and len(keeps) != len(token_lists):
            raise InvalidRequest(f"got {len(keeps)} keeps tuples for {len(token_lists)} prompts", param="keeps")
        return self._run(token_lists, _as_params_list(params, len(token_lists)), salt, session, keeps)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        salt: str | None = None,
        session: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the reply."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [encode_chat(self.tokenizer, c) for c in conversations]  # type: ignore[arg-type]
        return self._run(token_lists, _as_params_list(params, len(token_lists)), salt, session)

    def encode(self, prompt: PromptLike) -> list[int]:
        return encode(self.tokenizer, prompt)

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt)

    def close(self) -> None:
        """Write the RAM cache to the disk tier (EngineConfig.kv_disk_dir), so the next LLM on
        the same model and directory starts warm. A no-op without a disk tier."""
        self.engine.close()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run(
        self,
        token_lists: list[list[int]],
        params: list[SamplingParams],
        salt: str | None,
        session: str | None = None,
        keeps: Sequence[tuple[Keep, ...]] | None = None,
    ) -> list[RequestOutput]:
        # Check everything before queueing anything, so a bad prompt leaves nothing behind.
        for i, (tokens, p) in enumerate(zip(token_lists, params)):
            self.engine.check_request(tokens, p, salt)
            check_keeps(keeps[i] if keeps else (), len(tokens))
            if p.n > self.config.max_queue_len:
                raise QueueFull(f"n={p.n} is more than the waiting queue holds ({self.config.max_queue_len})", limit=self.config.max_queue_len)
        results: list[RequestOutput | None] = [None] * len(token_lists)

        def finished(i: int, output: RequestOutput) -> None:
            results[i] = output

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
