"""AsyncEngine: the engine thread, submission errors, streaming, aborts, failures, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixkv.engine.async_engine import AsyncEngine, EngineStepError, EngineStopped
from radixkv.engine.sampling_params import SamplingParams
from radixkv.errors import InvalidRequest, QueueFull

from tests.helpers.live_server import make_async_engine

PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def async_engine(tiny_llama):
    engine = make_async_engine(tiny_llama)
    yield engine
    engine.shutdown()


def assert_idle(async_engine: AsyncEngine) -> None:
    def check(engine):
        engine.check_invariants()
        assert engine.num_unfinished == 0 and engine.tree.locked_pages == 0

    async_engine.call(check).result(30)


async def run(async_engine, prompt, params, **kwargs):
    outputs = [output async for output in await async_engine.submit(prompt, params, **kwargs)]
    return outputs


def test_deltas_add_up_to_the_output_and_match_the_engine_run_alone(async_engine):
    params = SamplingParams(max_tokens=12)
    deltas = asyncio.run(run(async_engine, PROMPT, params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    final = deltas[-1].output
    assert [t for d in deltas for c in d.completions for t in c.token_ids] == final.token_ids
    assert "".join(c.text for d in deltas for c in d.completions) == final.text
    assert len(final.token_ids) == 12

    def alone(engine):  # the same request stepped directly, on the engine thread
        request_id = engine.add_request(PROMPT, params, request_id="alone")
        while True:
            for delta in engine.step():
                if delta.request_id == request_id and delta.finished:
                    return delta.output.token_ids

    assert async_engine.call(alone).result(30) == final.token_ids
    assert_idle(async_engine)


def test_concurrent_requests_from_many_tasks(async_engine):
    params = SamplingParams(max_tokens=8)
    prompts = [PROMPT[: 8 + i] for i in range(6)]

    async def main():
        solo = [(await run(async_engine, p, params))[-1].output.token_ids for p in prompts]
        together = await asyncio.gather(*(run(async_engine, p, params) for p in prompts))
        return solo, [outputs[-1].output.token_ids for outputs in together]

    solo, together = asyncio.run(main())
    assert together == solo
    assert_idle(async_engine)


def test_engine_errors_reach_the_submitter(async_engine):
    async def main():
        with pytest.raises(InvalidRequest, match="empty"):
            await async_engine.submit([], SamplingParams())
        with pytest.raises(InvalidRequest, match="maximum context length is 512"):
            await async_engine.submit(PROMPT, SamplingParams(max_tokens=500))
        outputs = await run(async_engine, PROMPT, SamplingParams(max_tokens=2))
        assert outputs[-1].finished

    asyncio.run(main())
    assert_idle(async_engine)


def test_queue_full_reaches_the_submitter(tiny_llama):
    staged = make_async_engine(tiny_llama, start=False, max_queue_len=2)
    for _ in range(2):  # fill the waiting queue before the engine thread runs
        staged.engine.add_request(PROMPT, SamplingParams(max_tokens=2))

    async def main():
        submit = asyncio.ensure_future(staged.submit(PROMPT, SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)
        staged.start()  # commands run before the first step, so the queue is still full
        with pytest.raises(QueueFull):
            await submit

    asyncio.run(main())
    staged.shutdown()


def test_closing_a_stream_aborts_its_request(async_engine):
    async def main():
        stream = await async_engine.submit(PROMPT, SamplingParams(max_tokens=400))
        first = await anext(stream)
        assert not first.finished
        stream.close()
        stream.close()  # idempotent

    asyncio.run(main())
    for _ in range(200):
        if async_engine.stats().num_unfinished == 0:
            break
        threading.Event().wait(0.02)
    assert async_engine.stats().num_unfinished == 0
    assert_idle(async_engine)


def test_engine_calls_run_on_the_engine_thread(async_engine):
    assert async_engine.call(lambda engine: threading.current_thread().name).result(10) == "radixkv-engine"


def test_build_makes_the_engine_on_the_thread_that_steps_it(tiny_llama):
    built_on: list[str] = []

    def make_engine():
        built_on.append(threading.current_thread().name)
        return make_async_engine(tiny_llama, start=False).engine

    async_engine = AsyncEngine.build(make_engine)
    try:
        assert built_on == ["radixkv-engine"]
        assert async_engine.call(lambda engine: threading.current_thread().name).result(10) == "radixkv-engine"
        deltas = asyncio.run(run(async_engine, PROMPT, SamplingParams(max_tokens=4)))
        assert deltas[-1].finished and len(deltas[-1].output.token_ids) == 4
        assert_idle(async_engine)
    finally:
        async_engine.shutdown()
    assert not async_engine.alive


def test_build_raises_the_engines_error_to_the_caller():
    def make_engine():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(make_engine)


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_llama):
    async_engine = make_async_engine(tiny_llama)
    runner = async_engine.engine.runner
    real_forward = runner.forward
    calls = {"n": 0}

    # The forward fails mid-request, for the whole batch (a row's own fault fails only its
    # request: tests/server/test_faults.py).
    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_forward(*args)

    runner.forward = flaky

    async def main():
        with pytest.raises(EngineStepError):
            await run(async_engine, PROMPT, SamplingParams(max_tokens=20))
        outputs = await run(async_engine, PROMPT, SamplingParams(max_tokens=4))
        assert outputs[-1].finished and len(outputs[-1].output.token_ids) == 4

    try:
        asyncio.run(main())
        assert_idle(async_engine)
    finally:
        async_engine.shutdown()


def test_shutdown_ends_running_streams_and_refuses_new_work(tiny_llama):
    async_engine = make_async_engine(tiny_llama)

    async def main():
        stream = await async_engine.submit(PROMPT, SamplingParams(max_tokens=400))
        await anext(stream)
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineStopped):
            async for _ in stream:
                pass
        with pytest.raises(EngineStopped):
            await async_engine.submit(PROMPT, SamplingParams())

    asyncio.run(main())
    assert not async_engine.alive
    assert async_engine.engine.num_unfinished == 0  # the thread is gone: safe to look directly
    async_engine.engine.check_invariants()


def test_stats_are_computed_when_read_not_after_every_loop(tiny_llama):
    async_engine = make_async_engine(tiny_llama, start=False)
    engine = async_engine.engine
    real_stats, reads = engine.stats, []

    def counted():
        reads.append(threading.current_thread().name)
        return real_stats()

    engine.stats = counted
    async_engine.start()
    try:
        asyncio.run(run(async_engine, PROMPT, SamplingParams(max_tokens=6)))
        assert reads == []  # steps and commands ran; nobody asked
        stats = async_engine.stats()
        assert reads == ["radixkv-engine"]  # on the engine thread, between steps
        assert stats.counters.num_output_tokens == 6 and stats.num_unfinished == 0
        assert asyncio.run(async_engine.stats_async()).counters.num_output_tokens == 6
        assert async_engine.num_unfinished() == 0
    finally:
        async_engine.shutdown()
    assert async_engine.stats().counters.num_output_tokens == 6  # as the stopped thread left them


def test_a_stats_read_during_a_long_step_answers_with_the_last_snapshot(tiny_llama):
    # /metrics and a router's load poll must answer while a step runs long (or is stuck);
    # they get the last snapshot, and a fresh one once the engine thread is free again.
    async_engine = make_async_engine(tiny_llama)
    release = threading.Event()
    try:
        asyncio.run(run(async_engine, PROMPT, SamplingParams(max_tokens=3)))
        before = async_engine.stats()
        busy = async_engine.call(lambda engine: release.wait(60))  # the engine thread is held
        assert async_engine.stats() is before
        assert asyncio.run(async_engine.stats_async()) is before
        release.set()
        busy.result(timeout=60)
        assert async_engine.stats() is not before
        assert async_engine.stats().counters.num_output_tokens == 3
    finally:
        release.set()
        async_engine.shutdown()
