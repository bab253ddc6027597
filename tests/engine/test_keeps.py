"""Keeps in the engine (engine/keeps.py): a request's keeps are applied once, right after the
step that computes its prompt (chunked or preempted alike), reported on its output, locked ones
pin, the step's one expiry pass ends them, the owner's caps hold, and a request aborted before
its prompt is computed keeps nothing and gives every page back."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixkv.engine.engine import Engine
from radixkv.engine.request import MAX_KEEPS, Batch, Keep
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import InvalidRequest, OwnerCapExceeded
from tests.helpers.engine import assert_pages_returned, make_llm, run_to_end

PAGE_SIZE = 4
NUM_PAGES = 128


def make(tiny_llama: Path, **options) -> Engine:
    defaults = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=8, max_retained_pages_per_owner=32)
    defaults.update(options)
    return make_llm(tiny_llama, **defaults).engine


def prompt(start: int, num_tokens: int) -> list[int]:
    """Distinct starts below 300 make prompts that share nothing within one engine."""
    return [1 + (start + i) % 300 for i in range(num_tokens)]


class Counting:
    """Counts the Keeper's applications (the engine's own, wrapped)."""

    def __init__(self, engine: Engine) -> None:
        self.calls = 0
        apply = engine.keeper.apply

        def counted(*args, **kwargs):
            self.calls += 1
            return apply(*args, **kwargs)

        engine.keeper.apply = counted  # type: ignore[method-assign]


class FakeClock:
    """One clock for the tree's retentions, the pins and the keeps' reported expiry."""

    def __init__(self, engine: Engine) -> None:
        self.now_s = 1000.0
        engine.tree._now_s = self
        engine.pins._clock = self
        engine.keeper._clock = self

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return make(tiny_llama, num_pages=256)


def test_a_chunked_prompt_is_kept_once_right_after_its_last_chunk_and_reported(engine: Engine) -> None:
    tokens = prompt(0, 41)  # 10 full pages, six chunks of at most 8 tokens
    counting = Counting(engine)
    request_id = engine.add_request(tokens, SamplingParams(max_tokens=4), owner="alice", keeps=(Keep(41, 60.0),))
    seq = engine.requests[request_id][0]
    steps = 0
    while seq.num_computed_tokens < len(tokens):
        assert seq.kept is None and not engine.tree.retentions("alice")  # nothing kept mid-prefill
        engine.step()
        steps += 1
    assert steps == 6 and counting.calls == 1
    assert seq.kept is not None and seq.kept.num_kept_tokens == (40,)
    assert [r.num_pages for r in engine.tree.retentions("alice")] == [10]
    output = run_to_end(engine)[request_id]
    assert counting.calls == 1  # decode steps never apply it again
    assert output.kept is seq.kept
    assert output.kept.num_written_tokens == 40 and output.kept.expires_at_s is not None
    # The same prompt again finds it cached: kept again, written by nobody new.
    again = engine.add_request(tokens, SamplingParams(max_tokens=1), owner="alice", keeps=(Keep(41, 60.0),))
    repeat = run_to_end(engine)[again]
    assert repeat.num_cached_tokens == 40 and repeat.kept.num_kept_tokens == (40,) and repeat.kept.num_written_tokens == 0
    assert_pages_returned(engine)


def test_a_request_preempted_before_or_after_its_prompt_is_computed_keeps_once(engine: Engine) -> None:
    counting = Counting(engine)
    early = engine.add_request(prompt(100, 33), SamplingParams(max_tokens=3), owner="bob", keeps=(Keep(33, 60.0),))
    engine.step()  # one chunk of eight
    seq = engine.requests[early][0]
    assert 0 < seq.num_computed_tokens < 33 and seq.kept is None
    engine.scheduler._preempt(seq, Batch())  # recomputed from the start later
    late = engine.add_request(prompt(200, 9), SamplingParams(max_tokens=6), owner="bob", keeps=(Keep(9, 60.0),))
    late_seq = engine.requests[late][0]
    while late_seq.kept is None:
        engine.step()
    assert late_seq.output_token_ids  # still decoding: preempt it after its keep
    engine.scheduler._preempt(late_seq, Batch())
    outputs = run_to_end(engine)
    assert seq.num_preemptions == 1 and late_seq.num_preemptions == 1
    assert counting.calls == 2  # once per request
    assert outputs[early].kept.num_kept_tokens == (32,) and outputs[late].kept.num_kept_tokens == (8,)
    assert_pages_returned(engine)


def test_a_locked_keep_pins_under_the_pin_caps_and_a_refusal_is_reported(tiny_llama: Path) -> None:
    engine = make(tiny_llama, num_pages=256, max_pinned_pages_per_owner=8)  # room for pins beside a full context
    pinned = engine.add_request(prompt(300, 33), SamplingParams(max_tokens=2), owner="carol", keeps=(Keep(33, None, lock=True),))
    output = run_to_end(engine)[pinned]
    pin = output.kept.pin
    assert pin is not None and pin.num_pinned_tokens == 32 and pin.owner == "carol" and pin.expires_at_s is None
    assert output.kept.expires_at_s is None and output.kept.error is None
    assert engine.pins_of("carol") == [pin] and engine.tree.locked_pages == 8
    over = engine.add_request(prompt(400, 9), SamplingParams(max_tokens=2), owner="carol", keeps=(Keep(9, None, lock=True), Keep(9, 30.0)))
    refused = run_to_end(engine)[over]
    assert isinstance(refused.kept.error, OwnerCapExceeded) and refused.kept.error.limit == 8
    assert refused.kept.pin is None and refused.kept.num_kept_tokens == (0, 8)  # the retention still applied
    assert refused.outputs[0].finish_reason == "length"  # the request itself ran on
    assert engine.unpin(pin.pin_id, "carol")
    assert_pages_returned(engine)


def test_the_steps_one_expiry_pass_ends_retentions_and_pins(tiny_llama: Path) -> None:
    engine = make(tiny_llama, num_pages=256)
    clock = FakeClock(engine)
    retained = engine.add_request(prompt(500, 17), SamplingParams(max_tokens=1), owner="dave", keeps=(Keep(17, 10.0),))
    pinned = engine.add_request(prompt(600, 17), SamplingParams(max_tokens=1), owner="dave", keeps=(Keep(17, 20.0, lock=True),))
    outputs = run_to_end(engine)
    assert outputs[retained].kept.expires_at_s == pytest.approx(1010.0)
    assert outputs[pinned].kept.expires_at_s == pytest.approx(1020.0)
    clock.now_s = 1015.0
    assert engine.step() == []  # nothing to run; the expiry pass ran all the same
    assert not engine.tree.retentions("dave") and len(engine.pins_of("dave")) == 1
    clock.now_s = 1025.0
    engine.step()
    assert not engine.pins and engine.tree.locked_pages == 0
    assert_pages_returned(engine)


def test_the_owners_retention_cap_trims_a_keep(tiny_llama: Path) -> None:
    engine = make(tiny_llama, max_retained_pages_per_owner=4)
    request_id = engine.add_request(prompt(700, 41), SamplingParams(max_tokens=1), owner="erin", keeps=(Keep(41, 60.0),))
    output = run_to_end(engine)[request_id]
    assert output.kept.num_kept_tokens == (4 * PAGE_SIZE,) and output.kept.num_written_tokens == 4 * PAGE_SIZE
    assert sum(r.num_pages for r in engine.tree.retentions("erin")) == 4
    other = engine.add_request(prompt(800, 41), SamplingParams(max_tokens=1), owner="frank", keeps=(Keep(41, 60.0),))
    assert run_to_end(engine)[other].kept.num_kept_tokens == (16,)  # another owner's own cap
    assert sum(r.num_pages for r in engine.tree.retentions("erin")) == 4


def test_a_request_aborted_before_its_prompt_is_computed_keeps_nothing_and_returns_every_page(engine: Engine) -> None:
    counting = Counting(engine)
    request_id = engine.add_request(prompt(250, 41), SamplingParams(max_tokens=4), owner="gina", keeps=(Keep(41, 60.0), Keep(41, None, lock=True)))
    engine.step()
    engine.step()
    delta = engine.abort(request_id)
    assert delta is not None and delta.output is not None and delta.output.kept is None
    assert counting.calls == 0 and not engine.tree.retentions("gina") and not engine.pins_of("gina")
    assert_pages_returned(engine)


@pytest.mark.parametrize(
    ("keeps", "param"),
    [
        ((Keep(11, 60.0),), "keeps"),  # past the prompt
        ((Keep(-1, 60.0),), "keeps"),
        ((Keep(4, None),), "ttl"),  # a retention must end
        ((Keep(4, 0.0),), "ttl"),
        ((Keep(4, float("inf"), lock=True),), "ttl"),
        (tuple(Keep(4, 60.0) for _ in range(MAX_KEEPS + 1)), "keeps"),
        (((4, 60.0),), "keeps"),  # not a Keep
    ],
)
def test_keeps_are_checked_before_anything_is_queued(engine: Engine, keeps: tuple, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        engine.add_request(prompt(0, 10), SamplingParams(max_tokens=1), keeps=keeps)
    assert refused.value.param == param
    if len(keeps) > MAX_KEEPS:
        assert refused.value.limit == MAX_KEEPS
    assert not engine.has_unfinished()


def test_llm_generate_carries_keeps_per_prompt(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, page_size=PAGE_SIZE, num_pages=256)
    first, plain = llm.generate([prompt(0, 17), prompt(100, 17)], SamplingParams(max_tokens=1), keeps=[(Keep(17, 60.0),), ()])
    assert first.kept is not None and first.kept.num_kept_tokens == (16,) and plain.kept is None
    with pytest.raises(InvalidRequest) as refused:
        llm.generate([prompt(0, 17)], keeps=[(Keep(18, 60.0),)])
    assert refused.value.param == "keeps" and not llm.engine.has_unfinished()
