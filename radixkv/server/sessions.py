"""Which session a request names: OpenAI's prompt_cache_key (chat, completions, Responses) or
the X-Radixkv-Session header (any endpoint, Anthropic's Messages too), in the key space of the
API key's owner, with an idle time the X-Radixkv-Session-Idle-S header may ask for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from radixkv.engine.sessions import MAX_SESSION_KEY_CHARS, SessionRef
from radixkv.server.errors import APIError

SESSION_HEADER = "x-radixkv-session"
SESSION_IDLE_HEADER = "x-radixkv-session-idle-s"


def session_ref(
    headers: Mapping[str, str], owner: str, prompt_cache_key: str | None = None, namespace: str | None = None
) -> SessionRef | None:
    """The session a request names (None: none), checked before any work: a key of 1 to
    MAX_SESSION_KEY_CHARS characters, the header and prompt_cache_key naming the same one, an
    idle time that is a positive number (the engine holds it to max_session_idle_s). `namespace`:
    Tenants.session_namespace of the request's partition."""
    header = headers.get(SESSION_HEADER)
    if header is not None and prompt_cache_key is not None and header != prompt_cache_key:
        raise APIError(400, f"the {SESSION_HEADER} header and prompt_cache_key name different sessions", param="prompt_cache_key")
    key = header if header is not None else prompt_cache_key
    idle = headers.get(SESSION_IDLE_HEADER)
    if key is None:
        if idle is not None:
            raise APIError(400, f"{SESSION_IDLE_HEADER} needs a session ({SESSION_HEADER} or prompt_cache_key)", param=SESSION_IDLE_HEADER)
        return None
    if not 0 < len(key) <= MAX_SESSION_KEY_CHARS:
        param = SESSION_HEADER if header is not None else "prompt_cache_key"
        raise APIError(400, f"a session key must be 1 to {MAX_SESSION_KEY_CHARS} characters", param=param)
    return SessionRef(owner, key, _idle_s(idle), namespace)


def _idle_s(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        idle_s = float(value)
    except ValueError:
        idle_s = math.nan
    if not 0 < idle_s < math.inf:
        raise APIError(400, f"{SESSION_IDLE_HEADER} must be a positive number of seconds, got {value[:64]!r}", param=SESSION_IDLE_HEADER)
    return idle_s
