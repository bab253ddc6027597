"""Runs one workload on one engine in a fresh subprocess and measures it the same way for all.

Peers: radixkv, radixkv-nocache, radixkv-noshare (the cache on, cascade decode off),
hf-generate (transformers `generate`, one request at a time),
hf-batch (transformers `generate_batch`, continuous batching with block sharing),
llama-cpp-python (llama.cpp's Python binding with its RAM prompt cache, one request at a time,
when installed; "llama.cpp" is its older name). llama.cpp's own server, the CPU peer over HTTP,
is scenarios/llama_server.py's. Every request arrives at t0;
time to first token is measured from t0. A subprocess per peer keeps threads, memory peaks
and warm caches from leaking between peers.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PEERS = ("radixkv", "radixkv-nocache", "radixkv-noshare", "hf-generate", "hf-batch", "llama-cpp-python", "llama.cpp")


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int
    model: str | None = None  # None: the default SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "auto"  # radixkv's and transformers' peers; llama.cpp's build here is CPU-only
    page_size: int = 16
    max_batch_tokens: int = 2048
    # Round of each prompt (None: all in round 0). A round is submitted once the previous one
    # has finished, as a chat turn is sent after the reply to the last one has arrived.
    rounds: list[int] | None = None

    def round_indices(self) -> list[list[int]]:
        """Prompt indices grouped by round, rounds in order."""
        rounds = self.rounds or [0] * len(self.prompts)
        grouped: dict[int, list[int]] = {}
        for index, round_ in enumerate(rounds):
            grouped.setdefault(round_, []).append(index)
        return [grouped[r] for r in sorted(grouped)]


@dataclass(slots=True)
class PeerResult:
    peer: str
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    prefill_tokens_computed: int | None  # None where the peer does not report it
    cache_hit_rate: float | None
    peak_rss_bytes: int
    output_token_ids: list[list[int]]
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def run_in_subprocess(peer: str, workload: Workload, timeout_s: float = 3600) -> PeerResult:
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps(asdict(workload)))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-m", "radixkv.scenarios.peers", peer, str(spec), str(result)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not result.exists():
            tail = (proc.stderr or proc.stdout)[-1500:]
            return PeerResult(peer, 0.0, 0, [], None, None, 0, [], error=f"exit {proc.returncode}: {tail}")
        measured = PeerResult(**json.loads(result.read_text()))
    # Every peer runs with EOS ignored, so fewer tokens means it broke, and its wall time must not
    # count (transformers 5.17's generate_batch, on the GPU machine, returned none in 0.3 s).
    expected = len(workload.prompts) * workload.output_len
    if measured.output_tokens != expected:
        measured.error = f"made {measured.output_tokens} of the {expected} output tokens asked for"
    return measured


# -- the peers, each run inside the subprocess -----------------------------------------------


def _run_radixkv(workload: Workload, cache: bool, share_reads: bool = True) -> dict:
    from radixkv import LLM, SamplingParams

    llm = LLM(
        workload.model,
        dtype=workload.dtype,
        device=workload.device,
        page_size=workload.page_size,
        max_batch_tokens=workload.max_batch_tokens,
        enable_prefix_caching=cache,
        share_decode_reads=share_reads,
    )
    params = SamplingParams(max_tokens=workload.output_len, ignore_eos=True)
    _warm_up(llm)
    engine = llm.engine
    engine.tree.reset()
    computed_before = engine.counters.num_prompt_tokens_computed
    queries_before = engine.tree.stats()
    start = time.perf_counter()
    outputs: list = [None] * len(workload.prompts)
    for indices in workload.round_indices():
        round_start = time.perf_counter()
        for index, output in zip(indices, llm.generate([workload.prompts[i] for i in indices], params)):
            # Time to first token from t0 of the whole run, as for the sequential peers.
            output.time_to_first_token_s += round_start - start
            outputs[index] = output
    wall = time.perf_counter() - start
    after = engine.tree.stats()
    query_tokens = after.query_tokens - queries_before.query_tokens
    return dict(
        wall_s=wall,
        output_tokens=sum(len(o.token_ids) for o in outputs),
        ttft_s=[o.time_to_first_token_s for o in outputs],
        prefill_tokens_computed=engine.counters.num_prompt_tokens_computed - computed_before,
        cache_hit_rate=(after.hit_tokens - queries_before.hit_tokens) / query_tokens if query_tokens else 0.0,
        output_token_ids=[o.token_ids for o in outputs],
    )


def _warm_up(llm) -> None:
    """First-call overheads off the clock: every kernel a run takes (on a GPU, Triton compiles
    each on its first launch, a second or more), i.e. prefill cold and over a cached prefix, and
    decode apart and in a cascade group (two requests sharing 128 tokens)."""
    from radixkv import SamplingParams

    shared = [(7 * i) % 200 + 10 for i in range(128)]  # ids every vocabulary has, tiny test ones too
    for _ in range(2):  # the second round hits the prefix the first one cached
        llm.generate([shared + [1, 2, 3], shared + [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))


def _hf_model(workload: Workload):
    import torch
    from radixkv.model.device import resolve_device, resolve_dtype
    from radixkv.model.loader import hf_reference_model

    device = resolve_device(workload.device)
    dtype = resolve_dtype(workload.dtype, device)
    model = hf_reference_model(workload.model, dtype)
    return model.to(device).eval()


def _run_hf_generate(workload: Workload) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    model = _hf_model(workload)

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls, self.first_time = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2 and self.first_time is None:  # call 1 is the prompt itself
                self.first_time = time.perf_counter()

        def end(self) -> None:
            pass

    outputs, ttfts = [], []
    with torch.inference_mode():
        model.generate(torch.tensor([[1, 2, 3, 4]], device=model.device), max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for prompt in workload.prompts:
            ids = torch.tensor([prompt], device=model.device)
            streamer = FirstToken()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=workload.output_len,
                min_new_tokens=workload.output_len,
                do_sample=False,
                streamer=streamer,
            )
            outputs.append(out[0, len(prompt) :].tolist())
            ttfts.append(streamer.first_time - start)
        wall = time.perf_counter() - start
    return dict(
        wall_s=wall,
        output_tokens=sum(map(len, outputs)),
        ttft_s=ttfts,
        prefill_tokens_computed=sum(map(len, workload.prompts)),
        cache_hit_rate=0.0,
        output_token_ids=outputs,
    )


def _run_hf_batch(workload: Workload) -> dict:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _hf_model(workload)
    config = GenerationConfig(max_new_tokens=workload.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # page_size arrived in a later transformers 5 release; older ones keep their default.
    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    sizing = {"page_size": workload.page_size} if "page_size" in accepted else {}
    # Enough KV blocks for every prompt and its output unshared, so the cache never limits it;
    # left unset, transformers sizes its cache from the machine's memory, gigabytes for a
    # workload that needs megabytes, and spends its run allocating them.
    needed = sum(-(-(len(p) + workload.output_len) // workload.page_size) + 1 for p in workload.prompts)
    if "num_blocks" in accepted:
        sizing["num_blocks"] = needed
    batching = ContinuousBatchingConfig(allow_block_sharing=True, **sizing)
    with torch.inference_mode():
        model.generate_batch([[1, 2, 3, 4]], generation_config=config, continuous_batching_config=batching)
        start_clock = time.perf_counter()
        ordered: list = [None] * len(workload.prompts)
        for indices in workload.round_indices():
            results = model.generate_batch(
                [workload.prompts[i] for i in indices],
                generation_config=config,
                continuous_batching_config=batching,
                record_timestamps=True,
            )
            in_order = sorted(results.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
            for index, result in zip(indices, in_order):
                ordered[index] = result
        wall = time.perf_counter() - start_clock
    # record_timestamps uses perf_counter's clock, so the first token's stamp is comparable.
    ttfts = [r.timestamps[0] - start_clock if r.timestamps else None for r in ordered]
    return dict(
        wall_s=wall,
        output_tokens=sum(len(r.generated_tokens) for r in ordered),
        ttft_s=ttfts,
        prefill_tokens_computed=None,
        cache_hit_rate=None,
        output_token_ids=[list(r.generated_tokens) for r in ordered],
    )


def _run_llama_cpp(workload: Workload) -> dict:
    import llama_cpp  # optional extra; a missing module is reported as this peer's error

    from radixkv.model.loader import default_model_gguf

    path = workload.model if workload.model and workload.model.endswith(".gguf") else str(default_model_gguf())
    llm = llama_cpp.Llama(model_path=path, n_ctx=8192, n_threads=os.cpu_count() or 2, verbose=False)
    cache = llama_cpp.LlamaRAMCache(capacity_bytes=2 << 30)
    llm.set_cache(cache)
    start = time.perf_counter()
    outputs, ttfts = [], []
    for prompt in workload.prompts:
        # As create_completion uses its cache: restore the saved state with the longest common
        # prefix when it beats what is loaded; generate() then reuses the loaded prefix itself
        # (reset=True matches the prompt against the tokens already evaluated).
        try:
            saved = cache[prompt]
            if llm.longest_token_prefix(saved.input_ids.tolist(), prompt) > llm.longest_token_prefix(llm._input_ids.tolist(), prompt):
                llm.load_state(saved)
        except KeyError:
            pass
        tokens = []
        for token in llm.generate(prompt, temp=0.0):
            if not tokens:
                ttfts.append(time.perf_counter() - start)
            tokens.append(int(token))
            if len(tokens) >= workload.output_len:
                break
        cache[prompt + tokens] = llm.save_state()
        outputs.append(tokens)
    wall = time.perf_counter() - start
    return dict(
        wall_s=wall,
        output_tokens=sum(map(len, outputs)),
        ttft_s=ttfts,
        prefill_tokens_computed=None,
        cache_hit_rate=None,
        output_token_ids=outputs,
    )


def _main(argv: list[str]) -> None:
    peer, spec, result_path = argv
    workload = Workload(**json.loads(Path(spec).read_text()))
    runners = {
        "radixkv": lambda w: _run_radixkv(w, cache=True),
        "radixkv-nocache": lambda w: _run_radixkv(w, cache=False),
        "radixkv-noshare": lambda w: _run_radixkv(w, cache=True, share_reads=False),
        "hf-generate": _run_hf_generate,
        "hf-batch": _run_hf_batch,
        "llama-cpp-python": _run_llama_cpp,
        "llama.cpp": _run_llama_cpp,  # the binding's older name here, kept for old commands
    }
    if peer not in runners:
        raise SystemExit(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    measured = runners[peer](workload)
    from radixkv.scenarios.machine import process_memory

    # VmHWM: getrusage's ru_maxrss survives exec, so a child's would be at least its parent's peak.
    peak_rss = process_memory()["peak_rss_bytes"]
    Path(result_path).write_text(json.dumps(dict(peer=peer, peak_rss_bytes=peak_rss, **measured)))


if __name__ == "__main__":
    _main(sys.argv[1:])
