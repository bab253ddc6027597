"""Triton kernels of the GPU attention path, shipped as radixkv.kernels.

store_kv scatters new K/V into page slots; extend_attention runs new query tokens over a paged
prefix plus causally over themselves; paged_decode is split-KV decode over pages, with cascade groups (CascadeGroups) for requests
that share a cached prefix. Kernels know
only tensors; under TRITON_INTERPRET=1 (set before import) they run on CPU.
"""

from __future__ import annotations

from radixkv.kernels.extend_attention import ExtendConfig, extend_attention, extend_config
from radixkv.kernels.paged_decode import CascadeGroups, DecodeConfig, choose_num_splits, decode_config, paged_decode
from radixkv.kernels.store_kv import store_kv

__all__ = [
    "CascadeGroups",
    "DecodeConfig",
    "ExtendConfig",
    "choose_num_splits",
    "decode_config",
    "extend_attention",
    "extend_config",
    "paged_decode",
    "store_kv",
]
