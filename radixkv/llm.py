"""`LLM`: the in-process entry point — generate from prompts or chat conversations in batches.

It owns an `Engine`, tokenizes, submits every request at once (so the scheduler can share
their prefixes), steps until all end, and returns outputs in input order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

from radixkv.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.errors import InvalidRequest, QueueFull
from radixkv.engine.request import RequestOutput, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids."""
        prompt_list = _as_prompt_list(prompts)
        token_lists = [self.encode(p) for p in prompt_list]
        return self._run(token_lists, _as_params_list(params, len(token_lists)), salt)

    def chat(
        self,
        conversations: list[Message] | Seq[list[Message]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the reply."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.encode_chat(c) for c in conversations]  # type: ignore[arg-type]
        return self._run(token_lists, _as_params_list(params, len(token_lists)), salt)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        if not messages:
            raise InvalidRequest("a conversation needs at least one message")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def _run(self, token_lists: list[list[int]], params: list[SamplingParams], salt: str | None) -> list[RequestOutput]:
        # Validate everything before queueing anything, so a bad prompt leaves nothing behind.
        for tokens, p in zip(token_lists, params):
            self.engine._validate(tokens, p, salt)
            if p.n > self.engine.config.max_queue_len:
                raise QueueFull(f"n={p.n} is more than the waiting queue holds ({self.engine.config.max_queue_len})")
        pending = deque(zip(token_lists, params))
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            while pending or len(results) < len(ids):
                # More prompts than the queue holds are fed in as room frees up, in order.
                while pending and self.engine.queue_room() >= pending[0][1].n:
                    tokens, p = pending.popleft()
                    ids.append(self.engine.add_request(tokens, p, salt=salt))
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
        finally:
            for request_id in ids:  # an error or interrupt must not leave requests behind
                if request_id not in results:
                    self.engine.abort(request_id)
        return [results[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts  # type: ignore[return-value]


def _as_params_list(params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {count} prompts")
    return params
