"""A session's resume named in the headers starts the disk tier's read-ahead of its newest turn
before the body is read and parsed (a body that never parses still started it); another key
naming the same session starts nothing; the request that follows is served from the read."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.engine import wait_until
from tests.helpers.live_server import KEY_A, KEY_B, MODEL, make_async_engine, serve

PAGE_SIZE = 4
CONVERSATION = [{"role": "user", "content": "A long question about the weather in Paris, asked at length."}]


def test_a_resume_header_reads_the_turn_ahead_before_the_body(tiny_llama: Path, tmp_path: Path) -> None:
    with serve(make_async_engine(tiny_llama, kv_disk_dir=str(tmp_path / "kv"))) as live:
        headers = {"X-Radixkv-Session": "trip"}
        first = live.client(KEY_A).chat.completions.create(
            model=MODEL, messages=CONVERSATION, max_tokens=3, extra_headers=headers, extra_body={"ignore_eos": True}
        )
        reply = first.choices[0].message.content
        live.engine_call(lambda engine: engine.flush_cache(ram=True, disk=False))  # the turn now only on disk
        reads: list[tuple[int, int]] = []

        def count_reads(engine) -> None:
            tier = engine.cache_view.loader.tier
            real = tier.read

            def counted(tokens, salt, keys, start, num, **kwargs):
                reads.append((start, num))
                return real(tokens, salt, keys, start, num, **kwargs)

            tier.read = counted

        live.engine_call(count_reads)
        with live.http(KEY_B) as other:  # another key, the same session name: not its session
            refused = other.post("/v1/chat/completions", content=b"{not json", headers={**headers, "Content-Type": "application/json"})
        assert refused.status_code == 400
        live.engine_call(lambda engine: None)  # the hint, had there been one, ran before this
        assert reads == []
        with live.http(KEY_A) as mine:
            refused = mine.post("/v1/chat/completions", content=b"{not json", headers={**headers, "Content-Type": "application/json"})
        assert refused.status_code == 400  # never parsed, yet the turn is being read
        assert wait_until(lambda: len(reads) == 1, 10) and reads[0][0] == 0 and reads[0][1] >= 4
        hinted = reads[0][1]
        second = live.client(KEY_A).chat.completions.create(
            model=MODEL, max_tokens=1, extra_headers=headers,
            messages=CONVERSATION + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}],
        )  # fmt: skip
        assert second.usage.prompt_tokens_details.cached_tokens >= hinted * PAGE_SIZE
        stats = live.engine_call(lambda engine: engine.cache_view.disk_stats())
        assert stats.prefetched_blocks >= hinted
