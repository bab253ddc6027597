"""EngineConfig: every knob of the engine in one validated dataclass.

Each field carries its default and unit; invalid values raise ConfigError naming the field
and the accepted range, so a bad argument fails at construction rather than mid-run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from radixkv.errors import ConfigError

POLICIES = ("lpm", "fcfs")
# radixkv.cache.eviction.EVICTION_POLICIES; spelled out so the config stays free of torch
# (importing radixkv.cache loads it), and a test checks the two agree.
EVICTION_POLICIES = ("slru", "lru", "session", "predict")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# radixkv.cache.kv_dtype's storage dtypes of KV pages; "auto": the compute dtype (dtype).
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8", "fp8")
BACKENDS = ("auto", "torch", "cpu", "triton")
LINEAR_KERNELS = ("auto", "amx", "avx512_bf16", "avx2", "onednn")
QUANT_KERNELS = ("auto", "amx_int8", "avx512_vnni_zmm", "avx512_vnni", "avx2", "torch")
MOE_KERNELS = ("auto", "native", "native_fp32", "torch")
SPLIT_DECODE_ROWS = ("auto", "on", "off")
WEIGHT_DTYPES = ("auto", "float", "int8")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct; else an HF folder or .gguf
    page_size: int = 16  # tokens per KV page (= per cached block)
    num_pages: int | None = None  # None: sized from free memory and kv_memory_fraction
    kv_memory_fraction: float = 0.25  # share of free memory for KV pages when num_pages is None
    max_kv_pages: int = 65536  # cap on pages when sized from memory
    # Pages of the window layers' own pool on a model with layer groups (Gemma 3: full and
    # sliding-window layers; cache/layer_groups.py); None: sized from max_num_seqs and the chunk.
    num_window_pages: int | None = None
    max_batch_tokens: int = 2048  # tokens computed per step (prefill chunks + decode tokens)
    max_num_seqs: int = 64  # requests running at once
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    policy: str = "lpm"  # "lpm" (longest prefix match first) or "fcfs"
    lpm_fcfs_queue_threshold: int = 128  # above this many waiting requests LPM degrades to FCFS
    max_wait_steps: int = 64  # a request waiting longer than this many steps goes first
    enable_prefix_caching: bool = True
    # "auto": bf16 on CUDA, and on CPUs with native bf16 arithmetic (AMX, AVX512_BF16, aarch64
    # bf16); elsewhere fp32, since there bf16 is emulated and slower than fp32.
    dtype: str = "auto"
    # The dtype KV pages are stored in, apart from the compute dtype: "auto" stores the compute
    # dtype (exact against the float model); "bf16"/"fp16"/"fp32" round the stored K/V (the
    # kernels widen on load); "int8" stores symmetric int8 with an fp16 scale per (token, KV
    # head), about half a bf16 page (1.94x its tokens per byte at head_dim 64); "fp8" (e4m3) only on CUDA GPUs that have it. Greedy
    # output with and without the cache agrees bit for bit within one kv_dtype.
    kv_dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when available, else cpu
    # "auto": triton on CUDA; on CPU "cpu" (the native kernels) when native_kernels is on and
    # the library builds, else "torch" (the pure-torch reference).
    attention_backend: str = "auto"
    # radixkv's own kernels beside attention: on CPU the C kernels (paged decode, KV stores,
    # AMX/packed linears, row ops, the fused decode step), built with the system compiler on
    # first use; on CUDA the Triton row ops (residual add + RMSNorm, rope, SiLU * up). False:
    # the torch paths everywhere, as on a machine without a compiler.
    native_kernels: bool = True
    # Decode's q.k on AMX tiles where the CPU has them; False keeps it on AVX-512 (the two sum
    # in different orders, so some bf16 bits differ). One setting per process: the native
    # library holds it, and the CPU backend applies this value when it is built.
    decode_amx: bool = True
    # Cascade decode: requests that share a cached prefix (CPU: where the group saves reading 4
    # L2s of one layer's K and V, with 12+ query heads per KV head over 256+ tokens;
    # radixkv/cpu/decode.py says why) read its KV once per step as a group (q.k
    # and p.v as small matrix products, CPU native or Triton), merged by
    # log-sum-exp with each request's own suffix. Outputs equal plain decode's up to summation
    # order; in batch-invariant steps a group computes each member's own bits (its plain
    # kernel's arithmetic, as tiles where AVX512_BF16 allows), and on CPU a prefill's rows group
    # too: a request's rows whose keys end in the same 256-key chunk share the chunks before it.
    # False: each request (and each prefill row) reads all its KV itself.
    share_decode_reads: bool = True
    # CPU cascade groups' shared keys as matrix-product tiles (vdpbf16ps on AVX512_BF16 in bf16,
    # FMAs in fp32); False runs each member over them with the plain decode kernel, so any CPU
    # tests both. One setting per process, like decode_amx.
    cascade_tiles: bool = True
    # The fused CPU decode step (every layer in one native call) over T threads: "on" gives each
    # thread its own share of the rows through every layer, one thread a kernel, where "off"
    # splits each kernel's work over the threads. Split, no thread waits for the others between
    # kernels and one's attention (memory-bound) overlaps another's linears (compute-bound), but
    # every thread reads every layer's weights. "auto": split on 2 threads where a layer's
    # weights take at most four times one core's L2: SmolLM2's ~2 MB layers gain, the 1B shape's
    # ~39 MB and the 30B shape's ~11 MB attention layers lose, on a 1 MiB-L2 Zen 4 and a 2 MiB-L2
    # Xeon alike, where a quarter of L3 (the rule before) split the 1B shape on the Xeon's 260 MiB
    # L3 and lost (docs/measurements.md). Same bits either way.
    split_decode_rows: str = "auto"
    # Linears on CPU. bf16: "amx" (tiles), "avx512_bf16" (vdpbf16ps; any CPU with AVX512_BF16,
    # AMX machines included, so either machine tests the other's path) or "onednn" (torch's
    # library, over weights it packs once). fp32: "avx2" (FMAs over weights packed once; any
    # x86 CPU with AVX2, so every x86 machine tests it) or "onednn" (torch's own linear).
    # "auto": the fastest native kernel for the model's dtype that runs here. A named native
    # kernel this CPU cannot run, or that runs the other dtype, fails at load, naming why.
    linear_kernel: str = "auto"
    # Linears over quantized weights (a GGUF's Q8_0/Q4 blocks kept as they ship, or an HF
    # folder quantized at load): integer dot products with activations quantized per block of
    # 32: "avx512_vnni_zmm" (512-bit vpdpbusd over 16-row records), "avx512_vnni" (256-bit
    # vpdpbusd), "avx2" (vpmaddubsw) or "torch" (the reference, no native
    # library needed); "amx_int8" is reserved (no kernel yet: naming it fails at load). All
    # compute the same bits. "auto": the fastest that runs here; a named native kernel this CPU
    # cannot run fails at load, naming why.
    quant_kernel: str = "auto"
    # Mixture-of-experts layers (Qwen3-MoE): a GGUF's quantized experts are read in place from
    # a memory map of the file. "native": csrc/moe.c groups a step's tokens by expert and reads
    # each routed expert's blocks once; "torch": its reference (same bits, slow); "native_fp32":
    # also float experts (weight_dtype="float", fp32) through the grouped fp32 kernel; "auto":
    # "native" where the library builds, else "torch".
    moe_kernel: str = "auto"
    # How weights are held. "auto": a GGUF's quantized tensors (Q8_0, Q4_0/Q4_1, Q4_K; other
    # k-quants requantized to 8 bits) stay quantized in their blocks, run by quant_kernel, a tied
    # lm_head and embedding sharing one copy; float tensors, and every HF folder weight, in dtype.
    # "float": every weight dequantized to dtype (the model transformers computes). "int8":
    # every linear, from any source, quantized at load to 8 bits per block of 32 (a GGUF's Q8_0
    # blocks as they are). Greedy output is exact cache on/off within one weight_dtype; against
    # the float model a quantized one diverges by what scenarios/perplexity.py measures.
    weight_dtype: str = "auto"
    # Check the Triton kernels' device indices (page table, slots, offsets) before each step;
    # each check syncs with the device. None: on under TRITON_INTERPRET=1 only.
    check_indices: bool | None = None
    max_queue_len: int = 4096  # waiting requests beyond this are refused (QueueFull)
    seed: int | None = None  # base seed of sampling for requests without their own; None: random
    # Seed of the block-hash chain. None: random per process, so block hashes cannot be
    # predicted (or precomputed to collide) from outside; set it only to reproduce hashes.
    hash_seed: int | None = None
    check_invariants: bool = False  # debug: check page accounting after every step
    # Cache retention (Anthropic cache_control ttl, OpenAI prompt_cache_retention): the most
    # KV pages one owner (an API key) may keep retained at once, summed over its retentions.
    # Past it the owner's oldest retentions are released; a single prefix longer than it
    # retains only its first this-many pages. 0 turns retention off.
    max_retained_pages_per_owner: int = 1024
    # And over all owners together, at most this share of the page pool is retained at once:
    # past it an owner's own oldest retentions go first, then its new retention is trimmed to
    # the pages that fit (it retains fewer tokens, and says so), never another owner's.
    max_retained_pages_fraction: float = 0.5
    # Sessions (OpenAI's prompt_cache_key, the X-Radixkv-Session header; engine/sessions.py):
    # a session's newest turn (prompt and reply) stays retained this many seconds after the
    # turn ends; a request may ask for less or more, up to max_session_idle_s.
    session_idle_s: float = 600.0
    max_session_idle_s: float = 3600.0
    # Live sessions one owner (an API key) may hold at once; a new one past it ends the owner's
    # least recently active idle session, and is refused (429) only while all of them run.
    max_sessions_per_owner: int = 64
    # KV pages one owner's sessions retain together (also within max_retained_pages_per_owner,
    # which they share with the owner's other retentions); past it the owner's least recently
    # active sessions give up theirs first.
    max_session_pages_per_owner: int = 1024
    # Block hashes evicted from RAM (or dropped by the disk tier) remembered, least recently
    # evicted out first, so a cache report tells "evicted" from "never seen"
    # (radixkv/cache/ghost.py). None: four per page of the pool. A block costs about 100 bytes.
    max_ghost_blocks: int | None = None
    # Pins (Engine.pin: a prefix locked against eviction until unpinned or its ttl): KV pages
    # one owner's pins may lock together; None: a quarter of the page pool, so the cap scales
    # with the pool. The server's --max-pinned-pages-per-key.
    max_pinned_pages_per_owner: int | None = None
    # And all pins together; None: half the pool, and never so much that a request of the
    # whole context no longer fits beside them (pinned pages are never evicted).
    max_pinned_pages: int | None = None
    # Compute every token's numbers independently of what it is batched with (attention one
    # query row at a time; GEMMs in fixed 32-row blocks where the linears are not AMX's, whose
    # rows are independent already), so bf16 outputs are bit-identical with
    # the cache on or off and in any batch. Slower prefill; the torch and cpu backends only.
    # fp32 is exact without it (token for token), bf16 is not: see README, "Use it". None: on
    # where weights are kept quantized (weight_dtype), whose kernels round activations to int8,
    # turning a last-bit difference into another token often; off otherwise.
    batch_invariant: bool | None = None
    cache_dir: str | None = None  # converted-weights cache; None: ~/.cache/radixkv
    # Which unlocked cached blocks go first when pages run out: "slru" evicts blocks that never
    # served a hit (one request's private tail) before those that did, each least recently
    # used first, so a burst of one-off prompts cannot flush a hot system prompt; "lru" is
    # plain least recently used; "session" orders by what a session book marks (dead tails of
    # ended sessions first, then superseded turns, then unmarked blocks, then live sessions'
    # newest turns, each least recently used first; unmarked it is lru). Retained prefixes go
    # last under all three.
    eviction_policy: str = "slru"
    # The disk tier of the prefix cache: blocks evicted from RAM (and all of RAM's at close)
    # are kept as files under this directory, owner-only, and a match that runs out in RAM
    # continues there; a restart finds them. None: off. A directory that cannot be used turns
    # the tier off with a warning, never the engine. One directory per model is best: another
    # model's blocks are misses there, and both models' evictions share its budget.
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 16 << 30  # the tier's budget in bytes; the least recently used blocks go past it
    # Per retention owner (a tenant), at most this many bytes of the disk tier are retained
    # (evicted last); past it the owner's retentions that end first are given up there.
    kv_disk_retained_bytes_per_owner: int = 4 << 30
    # A disk hit is read on a background thread ahead of its use (while other requests, or the
    # request's own earlier chunks, compute); at most this many bytes are held read but unused.
    kv_disk_prefetch_bytes: int = 256 << 20
    # Serving health (AsyncEngine): after this many failed steps in a row, or while one step has
    # run longer than step_watchdog_s seconds, the engine reports itself unhealthy (/health 503)
    # so a supervisor can restart it; a step that succeeds again makes it healthy.
    max_consecutive_failed_steps: int = 3
    step_watchdog_s: float = 120.0
    # KV events in vLLM's schema (radixkv/kv_events), for indexers that route by cache
    # contents: a ZMQ PUB endpoint ("ipc:///run/radixkv/kv-events" binds this machine only;
    # "tcp://*:5557" binds every interface; "tcp://host:5557" connects to a subscriber that
    # binds). None: off. Needs the `events` extra. The socket has no authentication.
    kv_events_endpoint: str | None = None
    # A ROUTER endpoint (always bound) from which a subscriber that saw a gap in the sequence
    # numbers gets the missed batches again; None: no replay.
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""  # first frame of every message (llm-d reads "kv@<pod>@<model>")
    kv_events_buffer_steps: int = 10_000  # batches kept for replay
    # Send each stored block's token ids and extra keys (the tenants' prompts and cache salts)
    # too; off, BlockStored carries the block hashes only (token_ids [], extra_keys None).
    kv_events_token_ids: bool = False
    # Structured outputs (radixkv/engine/guide.py): what one JSON schema may cost before it is
    # refused (InvalidRequest, param response_format): its text in bytes, its JSON nesting, its
    # compile (on a compile thread, never the engine's) and its first token mask, the proxy
    # for the mask every later step of the request pays. A schema refused as slow is remembered.
    max_guide_schema_bytes: int = 128 << 10  # as the server's request cap (server/guards/request_caps.py)
    max_guide_schema_depth: int = 64
    guide_compile_timeout_s: float = 10.0
    guide_mask_timeout_s: float = 0.25

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _positive(self, "page_size", limit=4096)
        _positive(self, "max_batch_tokens", limit=1 << 20)
        _positive(self, "max_num_seqs", limit=1 << 16)
        _positive(self, "max_wait_steps", limit=1 << 30)
        _positive(self, "max_queue_len", limit=1 << 30)
        _positive(self, "lpm_fcfs_queue_threshold", limit=1 << 30)
        _positive(self, "max_kv_pages", limit=1 << 26)
        if self.num_pages is not None:
            _positive(self, "num_pages", limit=1 << 26)
        if self.num_window_pages is not None:
            _positive(self, "num_window_pages", limit=1 << 26)
        if self.max_retained_pages_per_owner != 0:
            _positive(self, "max_retained_pages_per_owner", limit=1 << 26)
        fraction = self.max_retained_pages_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ConfigError(f"max_retained_pages_fraction must be in (0, 1], got {fraction!r}", param="max_retained_pages_fraction")
        for name in ("session_idle_s", "max_session_idle_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 7 * 86400.0:
                raise ConfigError(f"{name} must be a number of seconds in (0, {7 * 86400}], got {value!r}", param=name)
        if self.session_idle_s > self.max_session_idle_s:
            raise ConfigError(
                f"session_idle_s ({self.session_idle_s!r}) must not pass max_session_idle_s ({self.max_session_idle_s!r})",
                param="session_idle_s",
            )
        _positive(self, "max_sessions_per_owner", limit=1 << 20)
        _positive(self, "max_session_pages_per_owner", limit=1 << 26)
        for name in ("max_pinned_pages_per_owner", "max_pinned_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 26):
                raise ConfigError(f"{name} must be None or an integer in [0, {1 << 26}], got {value!r}", param=name)
        if self.max_model_len is not None:
            _positive(self, "max_model_len", limit=1 << 24)
        if self.max_ghost_blocks is not None:
            _positive(self, "max_ghost_blocks", limit=1 << 28)
        _positive(self, "max_consecutive_failed_steps", limit=1 << 20)
        watchdog = self.step_watchdog_s
        if isinstance(watchdog, bool) or not isinstance(watchdog, (int, float)) or not 0.0 < watchdog <= 86400.0:
            raise ConfigError(f"step_watchdog_s must be a number of seconds in (0, 86400], got {watchdog!r}", param="step_watchdog_s")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction!r}")
        _choice(self, "policy", POLICIES)
        _choice(self, "eviction_policy", EVICTION_POLICIES)
        if self.kv_disk_dir is not None and (not isinstance(self.kv_disk_dir, str) or not self.kv_disk_dir.strip()):
            raise ConfigError(f"kv_disk_dir must be None or a directory path, got {self.kv_disk_dir!r}", param="kv_disk_dir")
        _positive(self, "kv_disk_bytes", limit=1 << 50)
        _positive(self, "kv_disk_retained_bytes_per_owner", limit=1 << 50)
        _positive(self, "kv_disk_prefetch_bytes", limit=1 << 40)
        _check_kv_events(self)
        _positive(self, "max_guide_schema_bytes", limit=1 << 26)
        _positive(self, "max_guide_schema_depth", limit=1 << 16)
        for name in ("guide_compile_timeout_s", "guide_mask_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 3600.0:
                raise ConfigError(f"{name} must be a number of seconds in (0, 3600], got {value!r}", param=name)
        _choice(self, "dtype", DTYPES)
        _choice(self, "kv_dtype", KV_DTYPES)
        _choice(self, "attention_backend", BACKENDS)
        _choice(self, "linear_kernel", LINEAR_KERNELS)
        _choice(self, "quant_kernel", QUANT_KERNELS)
        _choice(self, "moe_kernel", MOE_KERNELS)
        _choice(self, "split_decode_rows", SPLIT_DECODE_ROWS)
        _choice(self, "weight_dtype", WEIGHT_DTYPES)
        for name in ("native_kernels", "decode_amx", "share_decode_reads", "cascade_tiles"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}", param=name)
        if self.check_indices is not None and not isinstance(self.check_indices, bool):
            raise ConfigError(f"check_indices must be None, True or False, got {self.check_indices!r}", param="check_indices")
        if self.attention_backend == "cpu" and not self.native_kernels:
            raise ConfigError("attention_backend='cpu' runs the native kernels; it needs native_kernels=True", param="attention_backend")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def _positive(config: EngineConfig, name: str, *, limit: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ConfigError(f"{name} must be an integer in [1, {limit}], got {value!r}", param=name)


def _choice(config: EngineConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}", param=name)


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_kv_events(config: EngineConfig) -> None:
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.startswith(_ZMQ_SCHEMES)):
            raise ConfigError(f"{name} must be None or a ZMQ endpoint starting with one of {_ZMQ_SCHEMES}, got {value!r}", param=name)
    if config.kv_events_replay_endpoint is not None and config.kv_events_endpoint is None:
        raise ConfigError("kv_events_replay_endpoint replays the events of kv_events_endpoint; set that too", param="kv_events_replay_endpoint")
    if not isinstance(config.kv_events_topic, str):
        raise ConfigError(f"kv_events_topic must be a string, got {config.kv_events_topic!r}", param="kv_events_topic")
    _positive(config, "kv_events_buffer_steps", limit=1 << 24)
    if not isinstance(config.kv_events_token_ids, bool):
        raise ConfigError(f"kv_events_token_ids must be a bool, got {config.kv_events_token_ids!r}", param="kv_events_token_ids")


def default_cache_dir() -> Path:
    """Where converted weights and compiled kernels are kept: $XDG_CACHE_HOME/radixkv or ~/.cache/radixkv."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "radixkv"
