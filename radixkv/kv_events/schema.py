"""The KV-event wire schema of vLLM, so indexers written for vLLM (llm-d's KV-cache manager,
Dynamo's KV router) follow radixkv's cache unchanged: msgspec structs that encode to the same
msgpack, and the mapping of radixkv's block hashes onto the schema's integer hashes.

Followed: vllm/distributed/kv_events.py at vllm-project/vllm@0181ea3173e53eea8cf04a86891488e3dc89bb34
for the fields, with the wire shape that vLLM v0.26 publishes: since vllm-project/vllm#42892 each
event is a msgpack *map* tagged by its class name under "type" (fields by name, so consumers
ignore the ones they do not know), while the batch around them stays a positional array
`[ts, [event, ...], data_parallel_rank]` (what v0.26 sends and what llm-d, Dynamo and SGLang's
router decode). Fields with a default are left out when they hold it (msgspec omit_defaults).
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's ExternalBlockHash is `bytes | int`, and every consumer reads the int as an unsigned
# 64-bit value (vLLM itself sends the last 8 bytes of its sha256 digests, big-endian, as one).
# radixkv's block hashes are 128-bit xxh3 ints: the wire carries their low 64 bits, which is the
# same rule applied to the 16-byte big-endian digest. A 64-bit clash between two live blocks
# could only misroute a request in an indexer; radixkv itself matches on tokens, never on hashes.
WIRE_HASH_MASK = (1 << 64) - 1

# What the `medium` field names: where the blocks live. vLLM says "GPU" for device memory (and
# "CPU" for its CPU offload tier); radixkv's pages live in RAM when the engine runs on the CPU.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# KV cache groups as vLLM numbers them: group 0 the layers attending to every token (every
# layer of a dense model), sent so group-aware indexers file the blocks where vLLM's would be.
# A model with window layers (layer groups, cache/layer_groups.py) has a second group whose
# events say which blocks still hold their window KV; like vLLM's hybrid manager, each group
# stores and removes on its own, and consumers that know one group (Dynamo's router filters
# the others out) read group 0 alone, unchanged.
GROUP_IDX = 0
SPEC_KIND = "full_attention"
WINDOW_GROUP_IDX = 1
WINDOW_SPEC_KIND = "sliding_window"


def wire_hash(block_hash: int) -> int:
    return block_hash & WIRE_HASH_MASK


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float  # time.time() when the batch was published
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three events; `tag=True` writes the class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # a chain: each block's parent is the one before it
    parent_block_hash: int | None  # the parent of block_hashes[0]; None at the start of a prompt
    token_ids: list[int]  # block_size tokens per block, in order
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block: what else its hash covers besides tokens (vLLM: LoRA name, multimodal ids,
    # cache_salt); radixkv puts the cache salt on the first block of a salted prompt.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass
