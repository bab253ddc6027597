"""llama.cpp's own server as the CPU peer: `llama-server` on a GGUF with `-np` slots (continuous
batching), its host-memory prompt cache (--cache-ram) and, as an option, its unified KV (-kvu),
started on a free loopback port and driven by scenarios/serve_http.py's client like `radixkv serve`.

The binary comes from RADIXKV_LLAMA_SERVER (built from llama-cpp-python's sdist: CMake's
`llama-server` target). The llama-cpp-python binding running one request at a time stays the
`llama.cpp` peer of scenarios/peers.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from radixkv.errors import ConfigError
from radixkv.scenarios.serve_http import ServerProcess, free_port, launch

SERVER_ENV = "RADIXKV_LLAMA_SERVER"


@dataclass(frozen=True, slots=True)
class LlamaServerOptions:
    """How llama-server runs: slots, context per slot, threads, prompt cache, unified KV."""

    slots: int = 1
    ctx_per_slot: int = 4096
    threads: int = 2
    cache_ram_mib: int = 8192  # its prompt cache in host memory (its own default)
    unified_kv: bool = False  # one KV buffer for all slots (-kvu): a slot may use more than its share
    batch_size: int = 2048  # -b: prompt tokens per batch, as radixkv's max_batch_tokens

    @property
    def label(self) -> str:
        return f"llama-server{' -kvu' if self.unified_kv else ''}"


def binary() -> Path:
    value = os.environ.get(SERVER_ENV)
    if not value:
        raise ConfigError(f"set {SERVER_ENV} to the path of llama.cpp's llama-server binary", param=SERVER_ENV)
    if not Path(value).is_file():
        raise ConfigError(f"{SERVER_ENV}={value} is not a file", param=SERVER_ENV)
    return Path(value)


def command(gguf: Path, port: int, options: LlamaServerOptions) -> list[str]:
    args = [
        str(binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(options.slots), "-c", str(options.ctx_per_slot * options.slots), "-t", str(options.threads),
        "-tb", str(options.threads), "-b", str(options.batch_size), "--cache-ram", str(options.cache_ram_mib),
        "--metrics", "--no-webui",
    ]  # fmt: skip
    args.append("-kvu" if options.unified_kv else "-no-kvu")
    return args


def start_llama_server(gguf: Path, log_path: Path, options: LlamaServerOptions = LlamaServerOptions()) -> ServerProcess:
    """llama-server on `gguf`, ready once /health answers 200 (it answers 503 while loading)."""
    if not Path(gguf).is_file() or not str(gguf).endswith(".gguf"):
        raise ConfigError(f"llama-server needs a .gguf file, got {gguf}", param="model")
    port = free_port()
    return launch(options.label, command(Path(gguf), port, options), f"http://127.0.0.1:{port}", log_path).wait_ready()
