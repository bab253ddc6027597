"""Attention backends: one interface (prepare a step, store KV, extend, paged decode), with the
pure-torch reference, the CPU backend over the native kernels, and the Triton backend; cascade
planning (who reads a shared prefix once) in radixkv.attention.cascade."""

from __future__ import annotations

from radixkv.attention.base import AttentionBackend, AttentionMetadata, BackendCapabilities

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendCapabilities",
    "make_backend",
    "resolve_backend_name",
]


def resolve_backend_name(name: str, device: str, native_kernels: bool = True) -> str:
    """The backend "auto" stands for: triton on CUDA; on CPU "cpu" when native_kernels is on
    and the native library loads, else the "torch" reference. Other names as given."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "triton"
    if native_kernels:
        from radixkv.cpu.native import load

        if load() is not None:
            return "cpu"
    return "torch"


def backend_class(name: str) -> type[AttentionBackend]:
    """The class behind a resolved backend name, imported on first use (Triton's pulls in triton)."""
    if name == "torch":
        from radixkv.attention.torch_backend import TorchBackend

        return TorchBackend
    if name == "cpu":
        from radixkv.attention.cpu_backend import CPUBackend

        return CPUBackend
    if name == "triton":
        from radixkv.attention.triton_backend import TritonBackend

        return TritonBackend
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch', 'cpu' or 'triton'")


def make_backend(
    name: str,
    device: str,
    *,
    native_kernels: bool = True,
    decode_amx: bool = True,
    share_decode_reads: bool = True,
    check_indices: bool | None = None,
    cascade_tiles: bool = True,
) -> AttentionBackend:
    """The backend for `name` ("auto", "torch", "cpu", "triton") on `device`, set up from
    EngineConfig's fields of the same names."""
    name = resolve_backend_name(name, device, native_kernels)
    if name == "cpu":
        if not native_kernels:
            raise ValueError("attention_backend 'cpu' runs the native kernels; it needs native_kernels=True")
        return backend_class(name)(decode_amx=decode_amx, share_reads=share_decode_reads, cascade_tiles=cascade_tiles)
    if name == "triton":
        return backend_class(name)(check_indices=check_indices, share_reads=share_decode_reads, native_planner=native_kernels)
    return backend_class(name)()
