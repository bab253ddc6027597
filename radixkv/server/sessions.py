"""Which session a request names: OpenAI's prompt_cache_key (chat, completions, Responses) or
the X-Radixkv-Session header (any endpoint, Anthropic's Messages too), in the key space of the
API key's owner, with an idle time the X-Radixkv-Session-Idle-S header may ask for. Dynamo's
spellings are aliases: X-Dynamo-Session-ID names the session, X-Dynamo-Parent-Session-ID the
owner's session it branches from (a subagent's parent), X-Dynamo-Session-Final: true its last turn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from radixkv.engine.sessions import MAX_SESSION_KEY_CHARS, SessionRef
from radixkv.server.errors import APIError

if TYPE_CHECKING:
    from radixkv.server.state import AppState

SESSION_HEADER = "x-radixkv-session"
SESSION_IDLE_HEADER = "x-radixkv-session-idle-s"
DYNAMO_SESSION_HEADER = "x-dynamo-session-id"  # an alias of SESSION_HEADER
PARENT_SESSION_HEADER = "x-dynamo-parent-session-id"
SESSION_FINAL_HEADER = "x-dynamo-session-final"


def session_ref(
    headers: Mapping[str, str], owner: str, prompt_cache_key: str | None = None, namespace: str | None = None
) -> SessionRef | None:
    """The session a request names (None: none), checked before any work: a key of 1 to
    MAX_SESSION_KEY_CHARS characters, the header and prompt_cache_key naming the same one, an
    idle time that is a positive number (the engine holds it to max_session_idle_s). `namespace`:
    Tenants.session_namespace of the request's partition."""
    header, header_name = headers.get(SESSION_HEADER), SESSION_HEADER
    alias = headers.get(DYNAMO_SESSION_HEADER)
    if alias is not None:
        if header is not None and header != alias:
            raise APIError(400, f"the {SESSION_HEADER} and {DYNAMO_SESSION_HEADER} headers name different sessions", param=DYNAMO_SESSION_HEADER)
        header, header_name = alias, DYNAMO_SESSION_HEADER
    if header is not None and prompt_cache_key is not None and header != prompt_cache_key:
        raise APIError(400, f"the {header_name} header and prompt_cache_key name different sessions", param="prompt_cache_key")
    key = header if header is not None else prompt_cache_key
    idle = headers.get(SESSION_IDLE_HEADER)
    parent = headers.get(PARENT_SESSION_HEADER)
    final = headers.get(SESSION_FINAL_HEADER)
    if key is None:
        for name, value in ((SESSION_IDLE_HEADER, idle), (PARENT_SESSION_HEADER, parent), (SESSION_FINAL_HEADER, final)):
            if value is not None:
                raise APIError(400, f"{name} needs a session ({SESSION_HEADER}, {DYNAMO_SESSION_HEADER} or prompt_cache_key)", param=name)
        return None
    if not 0 < len(key) <= MAX_SESSION_KEY_CHARS:
        param = header_name if header is not None else "prompt_cache_key"
        raise APIError(400, f"a session key must be 1 to {MAX_SESSION_KEY_CHARS} characters", param=param)
    if parent is not None and not 0 < len(parent) <= MAX_SESSION_KEY_CHARS:
        raise APIError(400, f"a parent session key must be 1 to {MAX_SESSION_KEY_CHARS} characters", param=PARENT_SESSION_HEADER)
    return SessionRef(owner, key, _idle_s(idle), namespace, parent=parent, final=_final(final))


def hint_resume(server: AppState, headers: Mapping[str, str], key: bytes | None) -> None:
    """The session the headers name, resumed: its newest turn starts being read back from disk
    now, before the body is read and parsed (Engine.read_ahead_session, on the engine's thread;
    not awaited). Only the key's own session in its default partition is found; a malformed or
    conflicting header starts nothing here and is refused by `session_ref` after the parse."""
    name = headers.get(SESSION_HEADER) or headers.get(DYNAMO_SESSION_HEADER)
    if name is None or not 0 < len(name) <= MAX_SESSION_KEY_CHARS:
        return
    tenants = server.tenants
    ref = SessionRef(tenants.owner(key), name, namespace=tenants.session_namespace(tenants.cache_salt(key, None)))
    try:
        server.engine.call(lambda engine: engine.read_ahead_session(ref))
    except RuntimeError:  # the engine stopped: the request itself gets the error
        pass


def _final(value: str | None) -> bool:
    if value is None:
        return False
    if value.strip().lower() not in ("true", "false"):
        raise APIError(400, f"{SESSION_FINAL_HEADER} must be true or false, got {value[:64]!r}", param=SESSION_FINAL_HEADER)
    return value.strip().lower() == "true"


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
