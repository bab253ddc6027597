"""Guided decoding end to end on a tiny random model: every guided continuation parses and
matches its schema (greedy and sampled, nested, strict), bad schemas are refused before anything
runs, preemption keeps the matcher, and unguided requests beside guided ones do not change."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixkv import GrammarGuide, InvalidRequest, JsonGuide, SamplingParams
from tests.helpers.engine import assert_pages_returned, make_llm

PROMPTS = ["The quick brown fox", "Question: what is the capital of France?", "def add(a, b):", "Prefix caching"]

# Bounded schemas: a random model never stops a free-running string or number by itself, and
# a continuation cut by max_tokens is not JSON. The bounds let every continuation close.
FLAT = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "score", "ok"],
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["city", "zip"],
        },
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "kind": {"enum": ["p", "q"]}},
                "required": ["x", "kind"],
            },
            "maxItems": 2,
        },
    },
    "required": ["name", "tags", "address", "points"],
}
OPTIONAL = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["color"],
}
SCHEMAS = {"flat": FLAT, "nested": NESTED, "optional": OPTIONAL}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


def _strict(schema: dict) -> dict:
    """The schema with every object closed: what strict promises."""
    if isinstance(schema, dict):
        closed = {key: _strict(value) for key, value in schema.items()}
        if schema.get("type") == "object":
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


def _assert_matches(output, schema: dict) -> dict:
    assert output.finish_reason == "stop", (output.text, output.finish_reason)
    value = json.loads(output.text)
    jsonschema.validate(value, _strict(schema))
    return value


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_guided_output_parses_and_matches_the_schema(llm, name):
    schema = SCHEMAS[name]
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=120, guide=JsonGuide(json.dumps(schema))))
    for output in outputs:
        _assert_matches(output.outputs[0], schema)
    assert_pages_returned(llm.engine)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_guided_output_parses_and_matches_the_schema(llm, name):
    schema = SCHEMAS[name]
    params = SamplingParams(max_tokens=120, temperature=1.2, top_p=0.95, seed=7, n=4, guide=JsonGuide(json.dumps(schema)))
    outputs = [output for result in llm.generate(PROMPTS, params) for output in result.outputs]
    # Arrays without maxItems let a random model go on until max_tokens ("length", text cut);
    # every reply that closed matches, and most close.
    closed = [output for output in outputs if output.finish_reason == "stop"]
    assert all(output.finish_reason == "length" for output in outputs if output not in closed)
    assert len(closed) * 2 >= len(outputs), [o.text for o in outputs]
    values = [_assert_matches(output, schema) for output in closed]
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1  # sampling still chooses
    assert_pages_returned(llm.engine)


def test_non_strict_schema_matches_without_closing_its_objects(llm):
    # Extra properties are allowed, so a random model may keep adding them until max_tokens;
    # whatever closed matches the schema.
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=3, guide=JsonGuide(json.dumps(FLAT), strict=False))
    outputs = [o for r in llm.generate(PROMPTS, params) for o in r.outputs]
    for output in outputs:
        if output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.text), FLAT)
        else:
            assert output.finish_reason == "length"
    assert any(output.finish_reason == "stop" for output in outputs)


def test_json_object_gives_an_object(llm):
    # Any object: a random model may keep adding properties until max_tokens (then the text is
    # cut, and says so by "length"); whatever closed is an object.
    greedy = llm.generate(PROMPTS + ["hello"], SamplingParams(max_tokens=64, guide=JsonGuide()))
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=1.0, seed=11, n=4, guide=JsonGuide()))
    outputs = [o for r in greedy + sampled for o in r.outputs]
    for output in outputs:
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)
        else:
            assert output.finish_reason == "length" and output.text.startswith("{")
    assert sum(output.finish_reason == "stop" for output in outputs) >= 2


def test_max_tokens_still_ends_a_guided_continuation_with_length(llm):
    output = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, guide=JsonGuide(json.dumps(NESTED))))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3
    assert output.text.startswith("{")


def test_ignore_eos_does_not_run_past_the_end_of_the_grammar(llm):
    params = SamplingParams(max_tokens=120, ignore_eos=True, guide=JsonGuide(json.dumps(FLAT)))
    output = llm.generate(PROMPTS[1], params)[0]
    _assert_matches(output.outputs[0], FLAT)


@pytest.mark.parametrize(
    "schema, words",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"type": "nonsense"}', "nonsense"),
        ('{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}', "missing"),
    ],
)
def test_invalid_schemas_are_refused_before_anything_runs(llm, schema, words):
    engine = llm.engine
    params = SamplingParams(guide=JsonGuide(schema))
    for submit in (lambda: engine.add_request([5, 6, 7], params), lambda: llm.generate(["ok", "also ok"], params)):
        with pytest.raises(InvalidRequest) as refused:
            submit()
        assert refused.value.param == "response_format"
        assert words in str(refused.value)
        assert not engine.has_unfinished() and not engine.scheduler.waiting
    assert_pages_returned(engine)


def test_guided_output_survives_preemption(tiny_llama):
    # 20 pages of 4 tokens for 6 requests that each grow to about 15: preemption is certain.
    llm = make_llm(tiny_llama, num_pages=20, max_num_seqs=6)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, guide=JsonGuide(json.dumps(FLAT)))
    results = llm.generate(PROMPTS + PROMPTS[:2], params)
    assert llm.stats().num_preemptions > 0
    for result in results:
        output = result.outputs[0]
        if output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.text), _strict(FLAT))
        else:
            assert output.finish_reason == "length"
    assert sum(r.finish_reason == "stop" for r in results) >= 1
    assert_pages_returned(llm.engine)


def test_unguided_requests_beside_guided_ones_do_not_change(llm):
    plain = SamplingParams(max_tokens=12)
    alone = [r.token_ids for r in llm.generate(PROMPTS, plain)]
    guided = SamplingParams(max_tokens=40, guide=JsonGuide(json.dumps(FLAT)))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * len(PROMPTS) + [guided] * len(PROMPTS))
    assert [r.token_ids for r in mixed[: len(PROMPTS)]] == alone
    for result in mixed[len(PROMPTS) :]:
        _assert_matches(result.outputs[0], FLAT)


@pytest.mark.parametrize("vocab", [49152, 1000])  # 1000: the last word half used
def test_native_mask_apply_equals_xgrammars(vocab):
    import torch
    import xgrammar

    from radixkv.cpu.native import load
    from radixkv.engine.guide import GuideMasks

    if load() is None:
        pytest.skip("needs the native kernels (no C compiler here)")
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    bitmask[:, ::3] = 0  # whole words disallowed, and whole words allowed
    bitmask[:, 1::5] = -1
    rows = [0, 3, 4, 7]
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    GuideMasks(rows, bitmask).apply(logits)
    assert torch.equal(logits, expected)


# A string only raw control bytes could continue: the grammar opens `{"a":"` and then every
# token it allows is masked out as a control byte, so the row has nowhere to go.
DEAD_END = {"type": "object", "properties": {"a": {"type": "string", "pattern": "\u0001+"}}, "required": ["a"]}


def test_a_guided_row_with_no_way_on_fails_alone(llm):
    # On the first main this tripped an assert in the step and failed every request beside it.
    engine = llm.engine
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], plain)[0].token_ids
    beside = engine.add_request(llm.tokenizer.encode(PROMPTS[0]), plain)
    doomed = engine.add_request([5, 6, 7, 9], SamplingParams(max_tokens=20, guide=JsonGuide(json.dumps(DEAD_END))))
    finished = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                finished[delta.request_id] = delta.output
    failed = dict(engine.take_failed())
    assert list(failed) == [doomed]
    assert isinstance(failed[doomed], InvalidRequest) and failed[doomed].param == "response_format"
    assert "allows no token" in str(failed[doomed])
    assert finished[beside].outputs[0].token_ids == alone  # the neighbour went on, unchanged
    assert_pages_returned(engine)


def test_a_token_the_grammar_refuses_raises_a_row_error_not_an_assert(llm):
    from radixkv.engine.guide import GuideRejected

    state = llm.engine.guides.new_state(JsonGuide(json.dumps(FLAT)))
    brace = llm.tokenizer.encode("{")[-1]
    not_json = llm.tokenizer.encode("x")[-1]
    with pytest.raises(GuideRejected):  # survives python -O, unlike the assert it replaces
        state.accept(not_json)
    assert brace != not_json


def test_schemas_over_the_size_and_nesting_limits_are_refused_before_compiling(llm):
    engine = llm.engine
    limits = engine.guides.compiler.limits
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(limits.max_schema_bytes // 20)}}
    deep: dict = {"type": "integer"}
    for _ in range(limits.max_schema_depth):
        deep = {"type": "array", "items": deep}
    very_deep = '{"a":' * 5_000 + "1" + "}" * 5_000  # past json's own recursion limit, within the bytes
    for schema, limit in ((json.dumps(huge), limits.max_schema_bytes), (json.dumps(deep), limits.max_schema_depth), (very_deep, limits.max_schema_depth)):
        with pytest.raises(InvalidRequest) as refused:
            engine.add_request([5, 6, 7], SamplingParams(guide=JsonGuide(schema)))
        assert refused.value.param == "response_format" and refused.value.limit == limit
    assert not engine.has_unfinished()


@pytest.mark.parametrize("option", ["guide_compile_timeout_s", "guide_mask_timeout_s"])
def test_a_schema_too_slow_to_compile_or_mask_is_refused_and_remembered(tiny_llama, option):
    # A limit no compile or mask can meet: every new schema is refused as too slow.
    llm = make_llm(tiny_llama, **{option: 1e-9})
    engine = llm.engine
    params = SamplingParams(guide=JsonGuide(json.dumps(FLAT)))
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request([5, 6, 7], params)
    assert refused.value.param == "response_format" and refused.value.code == "schema_too_complex"
    # Remembered: the resend is refused without a second compile.
    assert engine.guides.compiler.submit(params.guide).exception() is not None
    assert not engine.has_unfinished()
    assert llm.generate(["still serving"], SamplingParams(max_tokens=4))[0].finish_reason == "length"


def test_an_integer_or_number_without_bounds_closes_within_what_parsers_read(llm):
    # A bias toward "1" makes the model write digits for as long as the grammar lets it: an
    # integer without bounds ends within 64 bits, a number within a double's exact integers.
    one = llm.engine.tokenizer.encode("1", add_special_tokens=False)
    assert len(one) == 1
    for kind, (low, high) in (("integer", (-(1 << 63), (1 << 63) - 1)), ("number", (-(1 << 53), 1 << 53))):
        schema = {"type": "object", "properties": {"n": {"type": kind}}, "required": ["n"]}
        params = SamplingParams(max_tokens=200, guide=JsonGuide(json.dumps(schema)), logit_bias={one[0]: 30})
        output = llm.generate(["Count:"], params)[0].outputs[0]
        value = _assert_matches(output, schema)["n"]
        assert low <= value <= high and len(output.token_ids) < 60, output.text
    assert_pages_returned(llm.engine)


def test_bounds_are_added_only_where_a_schema_left_them_out():
    from radixkv.engine.guide import INTEGER_RANGE, NUMBER_RANGE, bounded_numbers

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "number", "minimum": 0},
            "c": {"type": ["integer", "null"], "maximum": 5, "exclusiveMinimum": -1},
            "d": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        },
        "enum": [{"type": "integer"}],  # data, not a schema: untouched
    }
    bounded = bounded_numbers(json.loads(json.dumps(schema)))
    props = bounded["properties"]
    assert (props["a"]["minimum"], props["a"]["maximum"]) == INTEGER_RANGE
    assert props["b"]["minimum"] == 0 and props["b"]["maximum"] == NUMBER_RANGE[1]
    assert props["c"] == schema["properties"]["c"]
    assert props["d"]["items"]["anyOf"][0] == {"type": "integer", "minimum": INTEGER_RANGE[0], "maximum": INTEGER_RANGE[1]}
    assert bounded["enum"] == [{"type": "integer"}]


@pytest.mark.parametrize(
    ("guide", "pattern"),
    [
        (GrammarGuide("regex", r"(yes|no), [0-9]{2}"), r"(yes|no), [0-9]{2}"),
        (GrammarGuide("ebnf", 'root ::= "Answer: " ("red" | "green" | "blue") "."'), r"Answer: (red|green|blue)\."),
    ],
    ids=["regex", "ebnf"],
)
def test_a_regex_or_a_grammar_holds_greedy_and_sampled_output(llm, guide, pattern):
    for params in (SamplingParams(max_tokens=40, guide=guide), SamplingParams(max_tokens=40, guide=guide, temperature=1.3, seed=2, n=3)):
        for result in llm.generate(PROMPTS, params):
            for output in result.outputs:
                assert output.finish_reason == "stop" and re.fullmatch(pattern, output.text), output.text
    assert_pages_returned(llm.engine)


@pytest.mark.parametrize(("guide", "words"), [(GrammarGuide("regex", "(unclosed"), "the regex cannot be compiled"),
                                              (GrammarGuide("ebnf", "root ::= missing_rule"), "the grammar cannot be compiled"),
                                              (GrammarGuide("ebnf", "x" * (129 << 10)), "the grammar has")])  # fmt: skip
def test_a_bad_regex_or_grammar_is_refused_before_anything_runs(llm, guide, words):
    with pytest.raises(InvalidRequest, match=words) as error:
        llm.generate(["hi"], SamplingParams(max_tokens=4, guide=guide))
    assert error.value.param == "response_format"
    assert_pages_returned(llm.engine)
