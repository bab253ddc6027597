"""Batch runs of one template over many rows, and shared prefixes computed ahead of time.

`run_batch` renders every row, submits them together, shows progress with the running cache
hit rate and returns results in row order; `warm` computes a prefix, `pin` also locks it
against eviction until unpinned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from radixkv.engine.sampling_params import SamplingParams
from radixkv.prompts import Prompt
from radixkv.sdk.backends import Pin, Result, as_backend
from radixkv.sdk.template import Message, PromptTemplate, Row, render_rows

Prefix = PromptTemplate | str | Sequence[int] | Sequence[Message] | Prompt


def run_batch(
    backend: Any,
    template: PromptTemplate,
    rows: Iterable[Row],
    params: SamplingParams | None = None,
    *,
    progress: bool = True,
) -> list[Result]:
    """One Result per row, in row order; a row that fails (a missing field, a prompt over the
    context) carries `error` and costs no other row."""
    runner = as_backend(backend)
    params = params or SamplingParams()
    chat = template.uses_chat(runner.chat)
    rendered = render_rows(template, list(rows), chat=chat, tokenizer=runner.tokenizer)
    results: list[Result | None] = [None] * len(rendered.prompts)
    bar = _Progress(len(results), enabled=progress)
    try:
        for i, message in rendered.errors.items():
            results[i] = Result(error=message)
            bar.add(results[i])
        todo = [i for i, prompt in enumerate(rendered.prompts) if prompt is not None]

        def done(j: int, result: Result) -> None:
            results[todo[j]] = result
            bar.add(result)

        if todo:
            runner.generate([rendered.prompts[i] for i in todo], params, on_result=done)  # type: ignore[misc]
    finally:
        bar.close()
    return results  # type: ignore[return-value]


def warm(backend: Any, prefix: Prefix) -> Result:
    """Compute `prefix` now (a one-token request) so later prompts that begin with it hit the
    cache; its pages stay until eviction needs them. Returns that request's Result."""
    runner = as_backend(backend)
    return runner.warm(_prefix_prompt(runner, prefix))


def pin(backend: Any, prefix: Prefix) -> Pin:
    """Warm `prefix` and lock its full pages against eviction until `unpin()` (or the end of a
    `with` block). Pinned pages are taken from what eviction can free: pin what is reused."""
    runner = as_backend(backend)
    return runner.pin(_prefix_prompt(runner, prefix))


def _prefix_prompt(runner: Any, prefix: Prefix) -> Prompt:
    if isinstance(prefix, Prompt):
        return prefix
    if isinstance(prefix, PromptTemplate):
        chat = prefix.uses_chat(runner.chat)
        if runner.tokenizer is not None:
            return Prompt(token_ids=prefix.shared_token_ids(runner.tokenizer, chat=chat))
        return prefix.shared_prompt(chat=chat)
    if isinstance(prefix, str):
        return Prompt(text=prefix)
    items = list(prefix)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return Prompt(token_ids=items)
    if items and all(isinstance(m, dict) for m in items):
        return Prompt(messages=[dict(m) for m in items], add_generation_prompt=False)
    raise TypeError("a prefix is a PromptTemplate, text, token ids or a list of chat messages")


class _Progress:
    """A tqdm bar over rows whose postfix is the cache hit rate: cached / prompt tokens so far."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, unit="row", desc="run_batch")
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.errors = 0

    def add(self, result: Result) -> None:
        self.num_prompt_tokens += result.num_prompt_tokens
        self.num_cached_tokens += result.num_cached_tokens
        self.errors += not result.ok
        if self._bar is not None:
            postfix = f"cache hit {self.hit_rate:.0%}" + (f", {self.errors} failed" if self.errors else "")
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
