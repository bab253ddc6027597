"""Guide compiles in worker processes: one owner's compiles run one at a time and owners take
turns, an owner's waiting compiles are bounded, a compile past its deadline is killed and only
that guide is remembered as too slow (never one that waited), grammars are cached per owner,
compile CPU is charged to its owner, and what makes compiles slow is capped before compiling."""

from __future__ import annotations

import json

import pytest

from radixkv import GrammarGuide, InvalidRequest, JsonGuide
from radixkv.engine import guide as guide_module
from radixkv.engine.guide import GuideCompiler, GuideLimits
from radixkv.engine.guide_compile import CompileQueues
from radixkv.errors import OwnerCapExceeded
from tests.helpers.engine import wait_until
from tests.helpers.guide_workers import HANG, hang_on_marker
from tests.helpers.tiny_models import tiny_tokenizer

FLAT = JsonGuide(json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}, "c": {"enum": [1, 2]}}, "required": ["a", "b", "c"]}), strict=True)  # fmt: skip
# Past the deadline the worker is killed; the test's deadline is short, and counts no queue time.
COMPILE_TIMEOUT_S = 0.3


def _hanging(n: int) -> GrammarGuide:
    return GrammarGuide("ebnf", f'root ::= "{HANG}{n}"')


@pytest.fixture
def compiler(monkeypatch):
    monkeypatch.setattr(guide_module, "TRANSFER_GRACE_S", 0.2)
    limits = GuideLimits(compile_timeout_s=COMPILE_TIMEOUT_S, max_queued_compiles_per_owner=2)
    compiler = GuideCompiler(tiny_tokenizer(), 320, [0], limits, worker_target=hang_on_marker)
    yield compiler
    compiler.close()


def test_an_owner_runs_one_compile_at_a_time_and_owners_take_turns():
    queues: CompileQueues[str] = CompileQueues(max_queued=2)
    assert queues.put("a", "a1") and queues.put("a", "a2") and queues.put("b", "b1")
    assert not queues.put("a", "a3")  # a's two waiting: the bound
    assert queues.take() == ("a", "a1")
    assert queues.state("a") == (1, 1)
    assert queues.take() == ("b", "b1")  # a has one running: b goes first
    assert queues.put("a", "a3")
    queues.done("a")
    assert queues.take() == ("a", "a2")
    assert queues.state("a") == (1, 1) and queues.state("b") == (1, 0)
    queues.done("b")
    queues.done("a")
    assert queues.take() == ("a", "a3")
    assert queues.put(None, "anonymous") and queues.take() == (None, "anonymous")  # None is an owner too


def test_an_owner_past_its_waiting_compiles_is_refused_with_the_limit_others_are_not(compiler):
    running = compiler.submit(_hanging(0), "a")
    assert wait_until(lambda: compiler.queues.state("a") == (1, 0))
    waiting = [compiler.submit(_hanging(n), "a") for n in (1, 2)]
    refused = compiler.submit(_hanging(3), "a")
    error = refused.exception(timeout=0)
    assert isinstance(error, OwnerCapExceeded)  # the server's 429
    assert (error.param, error.code, error.limit) == ("response_format", "compile_queue_full", 2)
    assert compiler.submit(FLAT, "b").result(timeout=120) is not None
    for future in (running, *waiting):
        assert future.exception(timeout=120).code == "schema_too_complex"


def test_a_slow_compile_never_refuses_another_owners_schema_nor_its_owners_next(compiler):
    # The attack: two grammars that compile past the deadline, from owner a.
    slow = [compiler.submit(_hanging(1), "a")]
    assert wait_until(lambda: compiler.queues.state("a") == (1, 0))
    slow.append(compiler.submit(_hanging(2), "a"))
    own_schema = compiler.submit(FLAT, "a")  # waits behind a's two, far past the deadline
    victim = compiler.submit(FLAT, "b")
    assert victim.result(timeout=120) is not None
    assert own_schema.result(timeout=120) is not None  # its wait did not count: compiled
    for future in slow:
        assert future.exception(timeout=120).code == "schema_too_complex"
    assert sum(worker.kills for worker in compiler.workers) == 2  # stopped at the deadline, not left running
    assert compiler.compiles == 4
    # Remembered for the slow guide of its owner alone: b's resend is a hit, a's slow one is
    # refused without a compile, and another owner's same grammar goes to a worker.
    assert compiler.submit(FLAT, "b").done() and compiler.submit(_hanging(1), "a").exception(timeout=0) is not None
    compiler.submit(_hanging(1), "c")
    assert sum(compiler.queues.state("c")) == 1


def test_a_killed_worker_is_started_again_for_the_next_compile(compiler):
    assert compiler.submit(_hanging(0), None).exception(timeout=120).code == "schema_too_complex"
    assert compiler.submit(FLAT, None).result(timeout=120) is not None
    (worker,) = compiler.workers  # one compile at a time: one worker was enough
    assert (worker.kills, worker.starts) == (1, 2)


def test_compiled_grammars_are_cached_per_owner(compiler):
    compiler.submit(FLAT, "a").result(timeout=120)
    assert compiler.compiles == 1
    assert compiler.submit(FLAT, "a").done()  # a's own hit: no compile
    assert compiler.compiles == 1
    compiler.submit(FLAT, "b").result(timeout=120)  # another owner never hits a's entry
    assert compiler.compiles == 2


def test_compile_cpu_is_charged_to_its_owner_killed_compiles_to_the_kill(compiler):
    compiler.submit(FLAT, "a").result(timeout=120)
    assert compiler.take_cpu_s("a") > 0
    assert compiler.take_cpu_s("a") == 0.0 and compiler.take_cpu_s("b") == 0.0  # taken once; b spent none
    compiler.submit(_hanging(0), "b").exception(timeout=120)
    assert compiler.take_cpu_s("b") >= COMPILE_TIMEOUT_S


@pytest.mark.parametrize(
    ("guide", "limit_name"),
    [
        (GrammarGuide("ebnf", "\n".join(["root ::= r0"] + [f'r{i} ::= "x" r{i + 1}' for i in range(600)] + ['r600 ::= "y"'])), "max_grammar_rules"),
        (GrammarGuide("ebnf", "root ::= " + "(" * 65 + '"x"' + ")" * 65), "max_schema_depth"),
        (GrammarGuide("regex", "(" * 65 + "x" + ")" * 65), "max_schema_depth"),
    ],
    ids=["rules", "grammar-nesting", "regex-nesting"],
)
def test_what_makes_a_grammar_slow_is_capped_before_it_compiles(compiler, guide, limit_name):
    error = compiler.submit(guide, "a").exception(timeout=0)
    assert isinstance(error, InvalidRequest) and error.param == "response_format"
    assert error.limit == getattr(compiler.limits, limit_name)
    assert compiler.compiles == 0 and not compiler.workers
