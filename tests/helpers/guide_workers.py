"""Compile-worker bodies for the guide tests, importable by a spawned worker process: the real
worker, except that a guide whose text holds HANG never finishes (a compile too slow to end)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

from radixkv.engine.guide_compile import CompileJob, Outcome, compile_job, serve

HANG = "HANG"


def hang_on_marker(conn: Connection, tokenizer_info_json: str, vocab_size: int) -> None:
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def run(job: CompileJob) -> Outcome:
        while HANG in job.text:
            time.sleep(60)  # a compile in C++ that nothing short of a kill stops
        return compile_job(compiler, job, vocab_size)

    serve(conn, run)
