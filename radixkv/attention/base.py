"""The attention backend interface, its capabilities, and the per-step metadata every backend reads.

A backend prepares its per-step state once per step, writes the step's new K/V into their page
slots, then runs extend attention (new query tokens over the request's paged prefix plus
causally over each other) or paged decode. Every backend's state meets `StepState`: what the
engine (KV reads) and the fused CPU decode (checked tables) may ask of it, and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from radixkv.errors import UnsupportedModel


@dataclass(frozen=True, slots=True)
class KVReads:
    """The KV a decode step's requests attend to through the kernel, in tokens summed over
    requests, and how many of those a group read once for all its members (cascade decode)
    instead of each member reading them itself."""

    tokens: int
    shared_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeTables:
    """What a decode-only step's native kernels read in place, checked by prepare() against
    the caches (the C code trusts every index): one new token per request."""

    slot_mapping: torch.Tensor  # [B] int64, contiguous, each < the cache's slots
    page_table: torch.Tensor  # [B, max_pages] int32, contiguous, each entry < the cache's pages
    seq_lens: torch.Tensor  # [B] int32, contiguous, each <= max_pages * page_size
    plan: torch.Tensor | None  # the step's cascade plan (radixkv.attention.cascade), None: no groups


class StepState(Protocol):
    """What may be asked of any backend's per-step state across the seam."""

    @property
    def kv_reads(self) -> KVReads | None:
        """The step's decode KV reads, None where this backend does not count them."""
        ...

    def decode_tables(self) -> DecodeTables | None:
        """The tables a fused native decode of this step may trust, None where none may run it
        (not decode-only, another device, shapes the kernels do not take, another backend)."""
        ...


StateT = TypeVar("StateT", bound=StepState)


@dataclass(slots=True)
class AttentionMetadata(Generic[StateT]):
    """Where one step's flat batch of tokens sits in the paged KV cache.

    The batch holds B requests; request b contributes q_lens[b] new tokens at flat rows
    cu_q_lens[b]:cu_q_lens[b+1], at positions prefix_lens[b] .. seq_lens[b]-1 of its sequence.
    Its KV (prefix and new tokens alike) lives in the pages page_table[b, :ceil(seq_lens[b]/page_size)].
    """

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset; < 0 means "do not store"
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0 past each request's pages
    cu_q_lens: torch.Tensor  # [B + 1] int32, offsets of each request's rows in the flat batch
    q_lens: torch.Tensor  # [B] int32, new tokens per request this step
    seq_lens: torch.Tensor  # [B] int32, prefix + new tokens per request after this step
    prefix_lens: torch.Tensor  # [B] int32, tokens whose KV was already in pages before this step
    max_q_len: int
    max_seq_len: int
    page_size: int
    # The same lengths as Python lists, so CPU code can loop without device syncs.
    q_lens_list: list[int]
    seq_lens_list: list[int]
    # Every row's result must not depend on the other rows (EngineConfig.batch_invariant): the
    # backend attends one query row at a time, and the model runs GEMMs in fixed row blocks
    # unless its linears are row-independent already.
    batch_invariant: bool = False
    # What the step's backend derived from this metadata in prepare() (gather indices, masks,
    # checked tables), read by every layer; its type is that backend's own state class. Outside
    # the backend only StepState's members are read (through `state`).
    backend_state: StateT | None = None
    # A model with layer groups (radixkv.cache.layer_groups): the same step for its window
    # layers, whose pages come from their own pool (its own page_table and slot_mapping, the
    # rest as here) and with its own backend state; None: every layer reads this one.
    window_meta: AttentionMetadata[StateT] | None = None

    def for_window(self, window: int | None) -> AttentionMetadata[StateT]:
        """The metadata a layer with this window reads (its group's page table)."""
        return self.window_meta if window is not None and self.window_meta is not None else self

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_q_len == 1

    @property
    def state(self) -> StateT:
        """The backend's state for this step; begin_step() has set it."""
        assert self.backend_state is not None, "the backend's begin_step() has not run for this step"
        return self.backend_state


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One layer's paged KV as a backend stores and reads it: k_cache, v_cache [num_pages,
    page_size, num_kv_heads, head_dim] in the storage dtype; int8 caches with k_scales, v_scales
    [num_pages, page_size, num_kv_heads] (None for every other dtype)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend can do, so callers ask this rather than the backend's name."""

    # Runs EngineConfig.batch_invariant steps: every query row attends on its own.
    batch_invariant: bool = False
    # Its decode reads the CPU pages through the native kernel and its prepare() checks the
    # tables that kernel trusts, so its state may hand them out (StepState.decode_tables) and the
    # fused native decode step (radixkv.cpu.fused_decode) may run a decode-only step in its place.
    fused_cpu_decode: bool = False
    # Runs attention sinks (gpt-oss: a learned logit per query head in each softmax's
    # denominator, `sink_pages`); a model with sinks refuses a backend without them at build.
    attention_sinks: bool = False


class AttentionBackend(Generic[StateT]):
    """One attention implementation: prepare a step, store new KV, then extend or decode attention.

    q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the step's new tokens;
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim] for one layer, in the
    storage dtype (EngineConfig.kv_dtype), which may differ from q's compute dtype: reads widen
    to q's dtype; int8 caches come with k_scales, v_scales [num_pages, page_size, num_kv_heads].
    Returns [T, num_q_heads, head_dim]. store_kv, extend, decode and forward read meta.state,
    which prepare() made for this step (StateT: this backend's own state class).
    A backend implements store_pages, extend_pages and decode_pages, which take the layer's
    caches and scales as one LayerPages; the public methods here bundle them.

    window: the layer's sliding window, W keys a query sees counting itself (a query at position
    p attends to keys p - W + 1 .. p); None attends to every key. A per-call argument, so one
    step's layers may each pass their own. With layer groups a window layer is called with its
    group's metadata (AttentionMetadata.window_meta), whose pages behind the window may be any
    page: the window masks them, so a backend must never let a masked key's value through.
    """

    name = "base"  # for messages and logs only: callers decide by capabilities
    capabilities = BackendCapabilities()

    def prepare(self, meta: AttentionMetadata[StateT], k_cache: torch.Tensor, num_q_heads: int) -> StateT:
        """This backend's state for the step: what every layer would otherwise derive again from
        meta, and the index checks its kernels rely on, run once. k_cache is any layer's cache
        (all layers share its shape); num_q_heads is the model's query head count."""
        raise NotImplementedError

    def begin_step(self, meta: AttentionMetadata[StateT], k_cache: torch.Tensor, num_q_heads: int) -> AttentionMetadata[StateT]:
        """meta with this backend's state for the step set on it (called once per step)."""
        meta.backend_state = self.prepare(meta, k_cache, num_q_heads)
        return meta

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata[StateT],
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """Write k, v into their slots meta.slot_mapping (< 0: do not store), rounded to the
        caches' storage dtype; int8 caches quantize each (token, head) row into k_scales and
        v_scales ([num_pages, page_size, num_kv_heads] fp16, radixkv.cache.kv_dtype)."""
        self.store_pages(k, v, LayerPages(k_cache, v_cache, k_scales, v_scales), meta)

    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata[StateT],
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        return self.extend_pages(q, k, v, LayerPages(k_cache, v_cache, k_scales, v_scales), meta, scale, window)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata[StateT],
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        return self.decode_pages(q, LayerPages(k_cache, v_cache, k_scales, v_scales), meta, scale, window)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata[StateT],
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """store_kv, then extend or decode; sinks [num_q_heads] (None: none): each head's
        softmax also counts exp(sink), as gpt-oss's attention does (`sink_pages`)."""
        pages = LayerPages(k_cache, v_cache, k_scales, v_scales)
        self.store_pages(k, v, pages, meta)
        if sinks is not None:
            return self.sink_pages(q, pages, meta, scale, window, sinks)
        if meta.is_decode_only:
            return self.decode_pages(q, pages, meta, scale, window)
        return self.extend_pages(q, k, v, pages, meta, scale, window)

    # What a backend implements: the public methods above bundle a layer's four page tensors
    # into one LayerPages, so each backend states them once rather than in every signature.
    def store_pages(self, k: torch.Tensor, v: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[StateT]) -> None:
        raise NotImplementedError

    def extend_pages(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: LayerPages,
                     meta: AttentionMetadata[StateT], scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError

    def decode_pages(
        self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[StateT], scale: float, window: int | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def sink_pages(self, q: torch.Tensor, pages: LayerPages, meta: AttentionMetadata[StateT], scale: float,
                   window: int | None, sinks: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Extend or decode attention (the step's KV stored already) whose softmax denominators
        also hold exp(sinks[head]); a backend with capabilities.attention_sinks implements it."""
        raise UnsupportedModel(f"the {self.name!r} attention backend does not run attention sinks")
