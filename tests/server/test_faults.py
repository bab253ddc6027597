"""Faults a request or the engine can hit: a row that breaks a step (NaN logits, a sampler
error) fails its request alone; failed or stuck steps make /health say 503; a failing abort
does not end the engine thread; no internal error text reaches a client.

Faults are injected by wrapping the real runner, sampler or engine methods on one engine;
everything else runs as in production."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from radixkv.engine.engine import Engine
from tests.helpers.engine import wait_until
from tests.helpers.live_server import MODEL, make_async_engine, serve

POISON = 311  # a request whose prompt starts with this token id gets the injected fault


class Faults:
    """Switchable faults around one engine's runner, sampler and abort."""

    def __init__(self, engine: Engine) -> None:
        self.nan_poisoned_rows = False
        self.sampler_fails_poisoned_rows = False
        self.forward_raises = False
        self.forward_sleeps_s = 0.0
        self.abort_raises = False
        self._batch_rows: list = []
        schedule, forward, sample, abort = engine.scheduler.schedule, engine.runner.forward, engine.sampler.sample, engine.abort

        def scheduled(*args, **kwargs):
            batch = schedule(*args, **kwargs)
            self._batch_rows = [item.seq for item in batch.items if item.samples] if batch else []
            return batch

        def forwarded(*args, **kwargs):
            if self.forward_raises:
                raise RuntimeError("SECRET-internal: /opt/model/weights.bin failed")
            if self.forward_sleeps_s:
                time.sleep(self.forward_sleeps_s)
                self.forward_sleeps_s = 0.0
            logits = forward(*args, **kwargs)
            if self.nan_poisoned_rows:
                with torch.inference_mode():
                    for row, seq in enumerate(self._batch_rows):
                        if seq.prompt_token_ids[0] == POISON:
                            logits[row] = float("nan")
            return logits

        def sampled(logits, seqs, *rest):
            if self.sampler_fails_poisoned_rows and any(seq.prompt_token_ids[0] == POISON for seq in seqs):
                raise RuntimeError("SECRET-internal: sampler broke")
            return sample(logits, seqs, *rest)

        def aborted(request_id):
            if self.abort_raises:
                self.abort_raises = False
                raise RuntimeError("SECRET-internal: abort broke")
            return abort(request_id)

        engine.scheduler.schedule, engine.runner.forward, engine.sampler.sample, engine.abort = scheduled, forwarded, sampled, aborted


@pytest.fixture()
def faulty(tiny_llama):
    async_engine = make_async_engine(tiny_llama, start=False, max_consecutive_failed_steps=2, step_watchdog_s=0.5)
    faults = Faults(async_engine.engine)
    async_engine.start()
    with serve(async_engine) as live:
        yield live, faults


def poisoned_and_healthy(live) -> tuple[dict, dict]:
    """A poisoned and a healthy completion, sent together so they share steps."""
    results: dict[str, object] = {}

    def post(name: str, prompt: list[int]) -> None:
        with live.http() as client:
            results[name] = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0})

    threads = [threading.Thread(target=post, args=(name, prompt)) for name, prompt in (("bad", [POISON, 5, 6, 7]), ("good", [9, 5, 6, 7]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results["bad"], results["good"]


@pytest.mark.parametrize("fault", ["nan_poisoned_rows", "sampler_fails_poisoned_rows"])
def test_a_row_that_breaks_a_step_fails_its_request_alone(faulty, fault):
    live, faults = faulty
    setattr(faults, fault, True)
    bad, good = poisoned_and_healthy(live)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert "SECRET" not in bad.text
    assert live.http().get("/health").status_code == 200  # a row's fault is not the engine's
    live.assert_idle_and_consistent()


def test_failed_steps_in_a_row_make_health_say_503_until_a_step_succeeds(faulty):
    live, faults = faulty
    faults.forward_raises = True
    with live.http() as client:
        for i in range(2):
            failed = client.post("/v1/completions", json={"model": MODEL, "prompt": f"fail {i}", "max_tokens": 2})
            assert failed.status_code == 500 and "SECRET" not in failed.text
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_down"
        faults.forward_raises = False
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200
        assert client.get("/health").status_code == 200
    live.assert_idle_and_consistent()


def test_a_step_past_the_watchdog_makes_health_say_503_while_it_runs(faulty):
    live, faults = faulty
    faults.forward_sleeps_s = 3.0
    with live.http() as client:
        worker = threading.Thread(target=client.post, args=("/v1/completions",), kwargs={"json": {"model": MODEL, "prompt": "slow", "max_tokens": 2}})
        worker.start()
        with live.http() as probe:
            assert wait_until(lambda: probe.get("/health").status_code == 503, 10)
            worker.join()
            assert probe.get("/health").status_code == 200
    live.assert_idle_and_consistent()


def test_an_abort_that_raises_does_not_end_the_engine_thread(faulty):
    live, faults = faulty
    faults.abort_raises = True
    live.async_engine.abort("no-such-request")
    assert wait_until(lambda: not faults.abort_raises, 10)
    assert live.async_engine.alive
    with live.http() as client:
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "alive", "max_tokens": 2}).status_code == 200
        assert client.get("/health").status_code == 200


class _Fatal(BaseException):
    """Not an Exception: ends the engine thread, as an interpreter-level failure would."""


def test_the_text_of_an_error_that_kills_the_engine_never_reaches_clients(faulty):
    live, faults = faulty
    step = live.async_engine.engine.step
    started = threading.Event()

    def fatal_step():
        started.set()
        raise _Fatal("SECRET-internal: CUDA error at 0xdeadbeef")

    with live.http() as client, client.stream(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "doomed", "max_tokens": 50, "stream": True}
    ) as streamed:
        live.async_engine.engine.step = fatal_step
        text = streamed.read().decode()
    assert started.is_set() and "SECRET" not in text and "engine_down" in text
    with live.http() as client:
        after = client.post("/v1/completions", json={"model": MODEL, "prompt": "later", "max_tokens": 2})
        health = client.get("/health")
    assert after.status_code == 503 and "SECRET" not in after.text
    assert health.status_code == 503 and "SECRET" not in health.text
    live.async_engine.engine.step = step
