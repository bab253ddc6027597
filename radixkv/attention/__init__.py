"""Attention backends: one interface (store KV, extend, paged decode), torch and Triton implementations."""

from __future__ import annotations

from radixkv.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "make_backend"]


def make_backend(name: str, device: str) -> AttentionBackend:
    """The backend for `name` ("auto", "torch", "triton") on `device`."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        from radixkv.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        from radixkv.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'triton'")
