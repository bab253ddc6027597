"""KV events in vLLM's published schema: what the prefix cache stores and evicts, sent over ZMQ
so that indexers written for vLLM can follow radixkv's cache. `schema` is the wire format,
`recorder` turns tree changes into events, `publisher` sends them (PUB) and replays them
(ROUTER). Off unless EngineConfig.kv_events_endpoint is set; needs the `events` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.config import EngineConfig
    from radixkv.kv_events.recorder import KVEventRecorder


def start_kv_events(config: EngineConfig, medium: str) -> KVEventRecorder:
    """Open the publisher's sockets for `config` and return the recorder to hang on the tree
    (tree.listener); the engine flushes it after each step and closes it on shutdown."""
    assert config.kv_events_endpoint is not None
    try:
        from radixkv.kv_events.publisher import ZmqEventPublisher
        from radixkv.kv_events.recorder import KVEventRecorder
    except ImportError as error:
        raise ConfigError(
            f"kv_events_endpoint needs pyzmq and msgspec ({error.name} is missing): pip install 'radixkv[events]'",
            param="kv_events_endpoint",
        ) from error
    publisher = ZmqEventPublisher(
        config.kv_events_endpoint,
        config.kv_events_replay_endpoint,
        topic=config.kv_events_topic,
        buffer_steps=config.kv_events_buffer_steps,
    )
    return KVEventRecorder(publisher, config.page_size, medium)
