"""KV events in vLLM's published schema: what the prefix cache stores and evicts, sent over ZMQ
so that indexers written for vLLM can follow radixkv's cache. `schema` is the wire format,
`recorder` turns tree changes into events, `publisher` sends them (PUB) and replays them
(ROUTER). Off unless EngineConfig.kv_events_endpoint is set; needs the `events` extra. Prompt
token ids and cache salts go out only with EngineConfig.kv_events_token_ids; an endpoint other
processes on the network could reach is warned about at start.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.config import EngineConfig
    from radixkv.kv_events.recorder import KVEventRecorder

logger = logging.getLogger(__name__)


def start_kv_events(config: EngineConfig, medium: str) -> KVEventRecorder:
    """Open the publisher's sockets for `config` and return the recorder to hang on the tree
    (tree.events.subscribe(recorder.listen)); the engine flushes it after each step and closes it on shutdown."""
    assert config.kv_events_endpoint is not None
    for endpoint in (config.kv_events_endpoint, config.kv_events_replay_endpoint):
        if endpoint is not None and not _local_only(endpoint):
            logger.warning(
                "KV events on %s: anyone who can reach it reads the cache's block hashes%s; "
                "bind ipc:// (or a loopback address) unless an indexer elsewhere needs them",
                endpoint, " and the tenants' prompt tokens and salts" if config.kv_events_token_ids else "",
            )
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
    return KVEventRecorder(publisher, config.page_size, medium, token_ids=config.kv_events_token_ids)


def _local_only(endpoint: str) -> bool:
    """Whether a socket on `endpoint` is reachable from this machine alone: ipc:// and
    inproc://, or tcp:// on a loopback address (a wildcard or '::' binds every interface)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")
