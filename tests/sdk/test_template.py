"""PromptTemplate: rendering as chat messages and plain text, per-row errors, the shared
prefix, and the warning when a field's placement breaks it."""

from __future__ import annotations

import warnings

import pytest

from radixkv.errors import InvalidRequest
from radixkv.prompts import encode
from radixkv.sdk import Prompt, PromptTemplate, TemplateError, TemplateWarning
from radixkv.sdk.template import render_rows
from tests.helpers.sdk import five_shot, rows


def test_chat_messages_and_plain_text():
    template = PromptTemplate(system="Label it.", examples=[({"review": "Bad."}, "negative"), ("Good.", "positive")], user="Review: {review}")
    assert template.fields == ("review",)
    assert template.messages({"review": "Fine."}) == [
        {"role": "system", "content": "Label it."},
        {"role": "user", "content": "Review: Bad."},
        {"role": "assistant", "content": "negative"},
        {"role": "user", "content": "Review: Good."},
        {"role": "assistant", "content": "positive"},
        {"role": "user", "content": "Review: Fine."},
    ]
    assert template.text("Fine.") == "Label it.\n\nReview: Bad. negative\n\nReview: Good. positive\n\nReview: Fine."
    assert template.shared_prompt(chat=False).text == "Label it.\n\nReview: Bad. negative\n\nReview: Good. positive\n\nReview: "
    assert template.shared_prompt(chat=True).messages == template.messages("x")[:-1]


def test_bad_templates_fail_at_construction():
    with pytest.raises(TemplateError, match="positional"):
        PromptTemplate(user="Review: {}")
    with pytest.raises(TemplateError, match="missing field"):
        PromptTemplate(examples=[({"text": "a"}, "b")], user="Review: {review}")
    with pytest.raises(TemplateError, match="exactly one field"):
        PromptTemplate(examples=[("a", "b")], user="{a} and {b}")


def test_rows_that_cannot_render_fail_alone(llm):
    template = PromptTemplate(system="Compare.", user="{a} vs {b}")
    rendered = render_rows(template, [{"a": "x", "b": "y"}, {"a": "x"}, "just text"], chat=True, tokenizer=llm.tokenizer)
    assert rendered.prompts[0] is not None and rendered.prompts[0].token_ids
    assert rendered.prompts[1] is None and "missing field(s) ['b']" in rendered.errors[1]
    assert rendered.prompts[2] is None and "exactly one field" in rendered.errors[2]


def test_every_row_begins_with_the_shared_token_ids(llm):
    template = five_shot()
    shared = template.shared_token_ids(llm.tokenizer, chat=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rendered = render_rows(template, rows(24), chat=True, tokenizer=llm.tokenizer)
    assert rendered.shared_prefix_tokens == len(shared)
    # The shared part is the system prompt and every example, up to the row's field.
    prefix_ids = encode(llm.tokenizer, template.shared_prompt(chat=True))
    assert len(shared) > len(prefix_ids) > 100
    for prompt in rendered.prompts:
        assert prompt.token_ids[: len(shared)] == shared


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_a_field_in_the_system_prompt_warns(llm, chat, with_tokenizer):
    template = PromptTemplate(
        system="You label reviews of {product}.", examples=[("Bad.", "negative"), ("Good.", "positive")], user="Review: {review}"
    )
    tokenizer = llm.tokenizer if with_tokenizer else None
    with pytest.warns(TemplateWarning, match=r"\['product'\] in the system prompt break the shared prefix"):
        rendered = render_rows(template, [{"product": "bikes", "review": "Fine."}], chat=chat, tokenizer=tokenizer)
    assert not rendered.errors


def test_a_well_placed_template_does_not_warn(llm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        render_rows(five_shot(), rows(4), chat=True, tokenizer=llm.tokenizer)
        render_rows(five_shot(), rows(4), chat=False, tokenizer=None)


def test_a_prompt_is_messages_or_text():
    with pytest.raises(InvalidRequest, match="exactly one of"):
        Prompt()
    with pytest.raises(InvalidRequest, match="exactly one of"):
        Prompt(messages=[], text="x")


def test_chat_rendering_follows_the_model_unless_the_template_says():
    assert PromptTemplate().uses_chat(True) and not PromptTemplate().uses_chat(False)
    assert not PromptTemplate(chat=False).uses_chat(True)
    with pytest.raises(TemplateError, match="no chat template"):
        PromptTemplate(chat=True).uses_chat(False)
