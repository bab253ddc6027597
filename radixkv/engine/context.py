"""The context a request must fit: its prompt's token ids, and prompt plus max_tokens, against
the model's context and the page pool. The one place a length is checked (servers do not repeat
it) and where max_tokens=None becomes the room left."""

from __future__ import annotations

from dataclasses import dataclass, replace

from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class ContextLimit:
    max_context_tokens: int  # the model's context, or less when the page pool is smaller
    max_model_len: int
    num_pages: int
    page_size: int
    vocab_size: int

    def check_prompt(self, prompt: list[int]) -> None:
        """InvalidRequest (param "prompt") unless `prompt` is token ids of this model that leave
        the context room for at least one more token."""
        if not prompt:
            raise InvalidRequest("the prompt is empty; it needs at least one token", param="prompt")
        # The length first: a prompt of millions of ids is refused without a scan of them.
        if len(prompt) >= self.max_context_tokens:
            raise self._exceeded(f"the prompt has {len(prompt)} tokens, which leaves no room for a completion", "prompt")
        self.check_token_ids(prompt)

    def check_lookup(self, prompt: list[int]) -> None:
        """InvalidRequest (param "prompt") unless `prompt` is at most the context's length of
        token ids of this model: no cached prefix is longer, and a lookup's work is bounded by
        it. Length first, so a longer one costs no scan."""
        if len(prompt) > self.max_context_tokens:
            raise self._exceeded(f"the prompt has {len(prompt)} tokens; a lookup takes at most that many", "prompt")
        self.check_token_ids(prompt)

    def check_token_ids(self, prompt: list[int]) -> None:
        """InvalidRequest (param "prompt") unless every id is a token of this model: checked
        before anything hashes or looks them up."""
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", param="prompt", limit=vocab)

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """check_prompt, the token ids the params name (stop ids, biased tokens), then prompt +
        max_tokens within the context (None: the room left)."""
        self.check_prompt(prompt)
        named = params.token_ids_named()
        if any(t >= self.vocab_size for t in named):
            param = "stop_token_ids" if any(t >= self.vocab_size for t in params.stop_token_ids) else "logit_bias"
            raise InvalidRequest(f"{param} names a token id outside this model's vocabulary [0, {self.vocab_size})", param=param, limit=self.vocab_size)
        total = len(prompt) + (params.max_tokens if params.max_tokens is not None else 1)
        if total > self.max_context_tokens:
            raise self._exceeded(f"the request needs {total} ({len(prompt)} prompt + {params.max_tokens} max_tokens)", "max_tokens")

    def most_tokens(self, prompt: list[int], params: SamplingParams) -> int:
        """The most tokens the request may hold: max_tokens None fills the context."""
        return len(prompt) + params.max_tokens if params.max_tokens is not None else self.max_context_tokens

    def filled(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        """`params` with max_tokens None replaced by the room the context leaves after
        `prompt` (a copy: params may be shared between requests)."""
        if params.max_tokens is not None:
            return params
        return replace(params, max_tokens=self.max_context_tokens - len(prompt))

    def _exceeded(self, what: str, param: str) -> InvalidRequest:
        text = f"this model's maximum context length is {self.max_context_tokens} tokens"
        if self.max_context_tokens < self.max_model_len:
            text += f" (the KV page pool holds {self.num_pages} pages of {self.page_size} tokens)"
        return InvalidRequest(f"{text}; {what}", param=param, code="context_length_exceeded", limit=self.max_context_tokens)
