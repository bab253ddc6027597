"""An engine's parts made from its config: the model on its attention backend (a configuration
the backend cannot run refused before the weights load), the cache beneath it (the page pool
sized from memory, the radix tree, the KV manager with its disk tier), its end ids and guides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.attention import make_backend
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.kv_dtype import resolve_kv_dtype
from radixkv.cache.layer_groups import LayerGroups, WindowPages
from radixkv.cache.pages import PagePool, available_memory_bytes
from radixkv.cache.radix import RadixTree
from radixkv.config import EngineConfig
from radixkv.engine.cache_view import CacheView
from radixkv.engine.compute_cost import ComputeCost
from radixkv.engine.disk_loader import open_disk_tier
from radixkv.engine.guide import GuideLimits, Guides
from radixkv.engine.kv_manager import KVManager
from radixkv.errors import ConfigError
from radixkv.model.loader import LoadedModel, load_model
from radixkv.prompts.harmony import harmony_tokens


def load_engine_model(config: EngineConfig, device: torch.device, loaded: LoadedModel | None = None) -> LoadedModel:
    """`loaded`, or the config's model loaded on a backend made for `device`; ConfigError for a
    batch-invariant config on a backend that cannot run it, before any weight is read."""
    backend = loaded.model.attention if loaded is not None else make_backend(
        config.attention_backend, device.type, native_kernels=config.native_kernels, decode_amx=config.decode_amx,
        share_decode_reads=config.share_decode_reads, check_indices=config.check_indices, cascade_tiles=config.cascade_tiles,
    )  # fmt: skip
    if config.batch_invariant and not backend.capabilities.batch_invariant:
        raise ConfigError(
            f"batch_invariant needs an attention backend that attends row by row ('torch' or 'cpu'), not {backend.name!r}",
            param="batch_invariant",
        )
    if loaded is not None:
        return loaded
    return load_model(
        config.model, backend, dtype=config.dtype, device=config.device, cache_dir=config.cache_dir,
        native_kernels=config.native_kernels, linear_kernel=config.linear_kernel,
        weight_dtype=config.weight_dtype, quant_kernel=config.quant_kernel, moe_kernel=config.moe_kernel,
        split_decode_rows=config.split_decode_rows,
    )  # fmt: skip


def kv_memory_bytes(available: int, loaded: LoadedModel) -> int:
    """Memory the KV pool may size itself from: the available memory less the weights read in
    place from the file (mapped experts). MemAvailable counts their page cache as free, yet
    every step reads them: pages sized into it would push the experts out to disk."""
    if loaded.device.type != "cpu":
        return available
    return max(0, available - loaded.mapped_bytes)


@dataclass(slots=True)
class EngineCache:
    """The cache an engine holds: pages stored in `kv_dtype`, the tree over them, the KV
    manager, the only mover of pages between sequences and the tree, and the whole-cache view
    over its parts (reports, flush, close)."""

    kv_dtype: torch.dtype
    pool: PagePool
    hasher: BlockHasher
    tree: RadixTree
    compute_cost: ComputeCost
    kv: KVManager
    view: CacheView
    groups: LayerGroups
    windows: WindowPages | None  # the window layers' pages, None for a model of one group


def build_cache(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> EngineCache:
    """The page pool (EngineConfig.num_pages, else sized from the memory `device` has free), its
    tree and KV manager (with the disk tier when the config names one)."""
    model_config = loaded.config
    # The pages' storage dtype (EngineConfig.kv_dtype); pages are sized in its bytes.
    kv_dtype = resolve_kv_dtype(config.kv_dtype, loaded.dtype, loaded.device)
    groups = LayerGroups(model_config.layer_windows, model_config.num_layers)
    if groups.grouped:
        num_pages, windows = _grouped_pools(config, loaded, device, groups, kv_dtype)
    else:
        num_pages, windows = config.num_pages or PagePool.pages_for_memory(
            kv_memory_bytes(available_memory_bytes(device), loaded), config.kv_memory_fraction, config.max_kv_pages,
            config.page_size, model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, kv_dtype,
        ), None  # fmt: skip
    pool = PagePool(
        num_pages, config.page_size, len(groups.full_layers), model_config.num_kv_heads, model_config.head_dim, kv_dtype, loaded.device
    )
    hasher = BlockHasher(config.page_size, seed=config.hash_seed)
    tree = RadixTree(
        pool, hasher, eviction_policy=config.eviction_policy, max_retained_pages=int(num_pages * config.max_retained_pages_fraction)
    )
    compute_cost = ComputeCost()
    kv = KVManager(
        pool, tree, hasher, config.enable_prefix_caching,
        open_disk_tier(config, loaded, pool.page_nbytes, kv_dtype, tree.events, windows.pool.page_nbytes if windows is not None else 0),
        compute_cost.estimate_s, config.kv_disk_prefetch_bytes, config.max_retained_pages_per_owner, config.max_ghost_blocks,
        windows,
    )  # fmt: skip
    return EngineCache(kv_dtype, pool, hasher, tree, compute_cost, kv, kv.cache_view(), groups, windows)


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """The ids that end a reply: the model config's, the tokenizer's own where it names one, and
    harmony's `<|return|>` and `<|call|>` for a model that speaks it (a GGUF's config may name
    only one of them, and a reply that runs past `<|call|>` invents the tool's answer)."""
    ids = set(loaded.config.eos_token_ids)
    if getattr(loaded.tokenizer, "eos_token_id", None) is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    marks = harmony_tokens(loaded.tokenizer)
    return ids | marks.stops if marks is not None else ids


def resolve_batch_invariant(config: EngineConfig, loaded: LoadedModel) -> bool:
    """The config's choice, or on where the model needs it and its backend can: quantized weights
    (int8 activations) are cache-exact only batch-invariant; see config."""
    if config.batch_invariant is not None:
        return config.batch_invariant
    return loaded.weight_format != "float" and loaded.model.attention.capabilities.batch_invariant


def build_guides(config: EngineConfig, loaded: LoadedModel, eos_ids: set[int]) -> Guides:
    """Structured output's compiler and masks, under the config's schema and time limits."""
    limits = GuideLimits(config.max_guide_schema_bytes, config.max_guide_schema_depth, config.guide_compile_timeout_s, config.guide_mask_timeout_s)
    return Guides(loaded.tokenizer, loaded.config.vocab_size, sorted(eos_ids), limits)



def _grouped_pools(
    config: EngineConfig, loaded: LoadedModel, device: torch.device, groups: LayerGroups, kv_dtype: torch.dtype
) -> tuple[int, WindowPages]:
    """A model with full and window layers: the full layers' page count and the window
    layers' pool. Sized from memory, the window pool is sized first (EngineConfig.num_window_pages,
    else from max_num_seqs and the chunk) and the full layers take the rest of the bytes."""
    model_config, page_size = loaded.config, config.page_size
    shape = (model_config.num_kv_heads, model_config.head_dim, kv_dtype)
    full_bytes = PagePool.bytes_per_page(page_size, len(groups.full_layers), *shape)
    window_bytes = PagePool.bytes_per_page(page_size, len(groups.window_layers), *shape)
    num_pages = config.num_pages
    budget = 0 if num_pages is not None else int(kv_memory_bytes(available_memory_bytes(device), loaded) * config.kv_memory_fraction)
    cap = num_pages if num_pages is not None else min(config.max_kv_pages, max(1, budget // (full_bytes + window_bytes)))
    # A chunk never spans more pages than the full pool has.
    least = groups.min_window_pages(page_size, min(config.max_batch_tokens, cap * page_size))
    num_window_pages = config.num_window_pages
    if num_window_pages is None:
        num_window_pages = max(least, min(cap, groups.auto_window_pages(page_size, config.max_batch_tokens, config.max_num_seqs)))
    elif num_window_pages < least:
        raise ConfigError(
            f"num_window_pages must be at least {least} (a window of {groups.window} tokens behind a chunk of up to "
            f"{config.max_batch_tokens} tokens, in pages of {page_size}), got {num_window_pages}",
            param="num_window_pages",
        )
    if num_pages is None:
        num_pages = max(1, min(config.max_kv_pages, (budget - num_window_pages * window_bytes) // full_bytes))
    window_pool = PagePool(num_window_pages, page_size, len(groups.window_layers), *shape[:2], kv_dtype, loaded.device)
    return num_pages, WindowPages(window_pool, groups.window)
