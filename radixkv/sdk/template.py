"""Prompt templates: a shared part (system prompt, few-shot examples) and a per-row user part.

`PromptTemplate` renders a row as chat messages (models with a chat template) or plain text
(base models); `render_rows` encodes every row, checks that each begins with the template's
shared token ids, and warns when a field's placement breaks that shared prefix.
"""

from __future__ import annotations

import string
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.prompts import Prompt, encode

Message = dict[str, str]
Row = Mapping[str, Any] | str

# Distinct values for every field: where renderings with different values stop agreeing is
# where the per-row part begins. Their first characters differ in kind (letters, a digit,
# punctuation, a newline, a common word) so that whatever token the text before a field merges
# into (" " + "A" where a vocabulary lacks " A"), one of them does not, and the common prefix
# ends before it.
_SENTINELS = ("A", "z", "7", "#", "the", "\n")
# A base-model rendering of a worked example: the user part, this, then the answer.
PLAIN_ANSWER_SEPARATOR = " "
PLAIN_PART_SEPARATOR = "\n\n"


class TemplateError(ValueError):
    """A row (or example) that the template cannot render: a missing field, a bad pattern."""


@dataclass(slots=True)
class PromptTemplate:
    """A system prompt, few-shot examples as `(fields, answer)` pairs, and a user pattern.

    Patterns use `str.format` fields (`"Review: {review}"`; write literal braces as `{{ }}`).
    A chat model sees: system, then each example as a user/assistant pair, then the row's
    user message. A base model sees the same parts as text, separated by blank lines, each
    example as `user + " " + answer`. Everything before the row's first field is the shared
    prefix that the cache serves to every row; a field in the system prompt cuts it short.

    `chat=None` renders through the chat template when the model has one; `chat=False` renders
    plain text even for a chat model (completion-style few-shot prompts suit small models).
    """

    system: str | None = None
    examples: Sequence[tuple[Row, str]] = ()
    user: str = "{input}"
    chat: bool | None = None
    fields: tuple[str, ...] = field(init=False)
    system_fields: tuple[str, ...] = field(init=False)
    _examples: list[tuple[dict[str, Any], str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        user_fields = _pattern_fields(self.user, "user")
        self.system_fields = _pattern_fields(self.system, "system") if self.system is not None else ()
        self.fields = tuple(dict.fromkeys(self.system_fields + user_fields))
        self._examples = []
        for i, example in enumerate(self.examples):
            try:
                fields_, answer = example
            except (TypeError, ValueError):
                raise TemplateError(f"example {i} must be a (fields, answer) pair, got {example!r}") from None
            example_fields = self._fields_of(fields_, user_fields)
            self._format(self.user, example_fields)  # fail at construction, not on the first row
            self._examples.append((example_fields, str(answer)))

    # -- rendering ---------------------------------------------------------------------------

    def messages(self, row: Row) -> list[Message]:
        values = self._fields_of(row, self.fields)
        messages = []
        if self.system is not None:
            messages.append({"role": "system", "content": self._format(self.system, values)})
        for example_fields, answer in self._examples:
            messages.append({"role": "user", "content": self._format(self.user, example_fields)})
            messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": self._format(self.user, values)})
        return messages

    def text(self, row: Row) -> str:
        values = self._fields_of(row, self.fields)
        parts = [] if self.system is None else [self._format(self.system, values)]
        for example_fields, answer in self._examples:
            parts.append(self._format(self.user, example_fields) + PLAIN_ANSWER_SEPARATOR + answer)
        parts.append(self._format(self.user, values))
        return PLAIN_PART_SEPARATOR.join(parts)

    def uses_chat(self, model_has_chat_template: bool) -> bool:
        """Whether rows render as chat messages on a model with (or without) a chat template."""
        if self.chat and not model_has_chat_template:
            raise TemplateError("the template asks for chat rendering (chat=True) but the model has no chat template")
        return model_has_chat_template if self.chat is None else self.chat

    def render(self, row: Row, *, chat: bool) -> Prompt:
        return Prompt(messages=self.messages(row)) if chat else Prompt(text=self.text(row))

    # -- the shared part ---------------------------------------------------------------------

    def shared_token_ids(self, tokenizer: Any, *, chat: bool) -> list[int]:
        """The token ids every row begins with: where renderings with different values part."""
        return common_prefix([encode(tokenizer, self.render(r, chat=chat)) for r in self._sentinel_rows()])

    def shared_prompt(self, *, chat: bool) -> Prompt:
        """The shared part without a tokenizer: the messages before the row's (chat), or the
        text before its first field (plain)."""
        if not chat:
            return Prompt(text="".join(common_prefix([list(self.text(r)) for r in self._sentinel_rows()])))
        if self.system_fields:
            raise TemplateError(
                f"the system prompt holds field(s) {list(self.system_fields)}, so no whole message is shared; "
                "pass a tokenizer to the backend to compute the shared tokens"
            )
        return Prompt(messages=self.messages(self._sentinel_rows()[0])[:-1], add_generation_prompt=False)

    def check_placement(self, encode_fn: Callable[[Prompt], Sequence[Any]], *, chat: bool, unit: str = "tokens") -> None:
        """Warn when the fields' placement shares less than the template could: a field in the
        system prompt makes every later part (examples included) per-row."""
        if not self.system_fields:
            return
        rows = self._sentinel_rows()
        shared = len(common_prefix([encode_fn(self.render(r, chat=chat)) for r in rows]))
        fixed_system = {name: _SENTINELS[0] for name in self.system_fields}
        possible = len(common_prefix([encode_fn(self.render({**r, **fixed_system}, chat=chat)) for r in rows]))
        if shared < possible:
            warnings.warn(
                f"field(s) {list(self.system_fields)} in the system prompt break the shared prefix: rows share "
                f"only the first {shared} {unit} of the template instead of {possible}; put per-row fields in "
                "the user part so the system prompt and examples are computed once",
                TemplateWarning,
                stacklevel=4,
            )

    # -- helpers -----------------------------------------------------------------------------

    def _sentinel_rows(self) -> list[dict[str, str]]:
        return [dict.fromkeys(self.fields, value) for value in _SENTINELS]

    def _fields_of(self, row: Row, names: Sequence[str]) -> dict[str, Any]:
        if isinstance(row, str):
            if len(names) != 1:
                raise TemplateError(f"a row given as a string needs a template with exactly one field; this one has {list(names)}")
            return {names[0]: row}
        if not isinstance(row, Mapping):
            raise TemplateError(f"a row must be a mapping of field values (or a string), got {type(row).__name__}")
        missing = [name for name in names if name not in row]
        if missing:
            raise TemplateError(f"the row is missing field(s) {missing}")
        return dict(row)

    @staticmethod
    def _format(pattern: str, values: Mapping[str, Any]) -> str:
        try:
            return pattern.format_map(values)
        except (KeyError, IndexError, AttributeError, ValueError) as error:
            raise TemplateError(f"cannot fill {pattern[:60]!r}: {error!r}") from None


class TemplateWarning(UserWarning):
    """A template whose rows share less of their prefix than they could."""


@dataclass(slots=True)
class RenderedRows:
    """Each row's prompt, or the error that kept it from rendering; and the shared prefix."""

    prompts: list[Prompt | None]
    errors: dict[int, str]
    shared_prefix_tokens: int | None  # None without a tokenizer


def render_rows(template: PromptTemplate, rows: Iterable[Row], *, chat: bool, tokenizer: Any | None) -> RenderedRows:
    """Render and (with a tokenizer) encode every row, checking the shared prefix.

    A row that fails to render is reported, not raised, so one bad row costs only itself.
    """
    prompts: list[Prompt | None] = []
    errors: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            prompt = template.render(row, chat=chat)
            if tokenizer is not None:
                prompt.token_ids = encode(tokenizer, prompt)
        except Exception as error:  # noqa: BLE001 - TemplateError, or the chat template refusing
            prompts.append(None)
            errors[i] = f"{type(error).__name__}: {error}"
        else:
            prompts.append(prompt)
    if tokenizer is None:
        template.check_placement(_characters, chat=chat, unit="characters")
        return RenderedRows(prompts, errors, None)
    template.check_placement(lambda p: encode(tokenizer, p), chat=chat)
    shared = template.shared_token_ids(tokenizer, chat=chat)
    broken = {i: len(common_prefix([p.token_ids, shared])) for i, p in enumerate(prompts) if p is not None}
    broken = {i: n for i, n in broken.items() if n < len(shared)}
    if broken:
        first = min(broken)
        warnings.warn(
            f"{len(broken)} of {len(prompts)} rows (first: row {first}) do not begin with the template's "
            f"{len(shared)} shared tokens (row {first} shares {broken[first]}): their field text merges with "
            "the tokens before it, so those rows share less of the cached prefix",
            TemplateWarning,
            stacklevel=3,
        )
    return RenderedRows(prompts, errors, len(shared))


def _characters(prompt: Prompt) -> list[str]:
    """A tokenizer-free stand-in for encode(): characters, with message boundaries marked."""
    if prompt.text is not None:
        return list(prompt.text)
    return [c for m in prompt.messages or () for c in f"\x00{m['role']}\x00{m['content']}\x01"]


def _pattern_fields(pattern: str, where: str) -> tuple[str, ...]:
    names = []
    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as error:
        raise TemplateError(f"the {where} pattern is not a valid format string ({error}); write literal braces as {{{{ }}}}") from None
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = name.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise TemplateError(f"the {where} pattern uses a positional field {{{name}}}; name it, e.g. {{review}}")
        names.append(root)
    return tuple(dict.fromkeys(names))


def common_prefix(sequences: Sequence[Sequence[Any]]) -> list[Any]:
    first = sequences[0]
    length = min(len(s) for s in sequences)
    for i in range(length):
        if any(s[i] != first[i] for s in sequences[1:]):
            return list(first[:i])
    return list(first[:length])
