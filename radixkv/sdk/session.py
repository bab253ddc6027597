"""Conversations that branch: a `Conversation` holds chat messages; `fork(k)` copies it k ways.
(`Session` is its deprecated name: "session" means the engine's named, retained conversation
of a key, engine/sessions.py.)

How forks share memory. A conversation is only its messages; the KV cache does the sharing. When
k forks of a conversation generate together (`generate_all`), their prompts begin with the
same tokens, so every *full* page of that common prefix is one physical page in the radix
tree, referenced by each fork's page table (computed once, by the previous turn or by the
first fork the scheduler admits). The partially filled last page of the common prefix is not
in the tree (only full blocks are hashed and cached), so each fork recomputes those few
tokens (fewer than a page) into a private page of its own and writes its continuation after
them: that is the copy-on-write of the last page, done by recomputing at most page_size - 1
tokens instead of copying KV. From then on each fork's new pages are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.engine.sampling_params import SamplingParams
from radixkv.prompts import Prompt
from radixkv.sdk.backends import Backend, GenerationError, Result, as_backend
from radixkv.sdk.template import Message


class Conversation:
    """A conversation on a backend: `user(text)`, then `generate(params)` for the reply.

    The reply (a Result: `.text`, token counts, `.num_cached_tokens`) is appended to the
    conversation. Each turn resends the whole conversation, and the prefix cache serves the
    earlier turns' pages, so a turn costs roughly its new tokens.
    """

    def __init__(self, backend: Any, system: str | None = None, *, messages: Sequence[Message] = ()) -> None:
        self.backend: Backend = as_backend(backend)
        if not self.backend.chat:
            raise ValueError(
                "a Conversation needs a chat model, and this model has no chat template; "
                "use run_batch with a PromptTemplate (which renders plain text) for base models"
            )
        self._messages: list[Message] = [{"role": "system", "content": system}] if system is not None else []
        self._messages += [dict(m) for m in messages]

    @property
    def messages(self) -> list[Message]:
        return [dict(m) for m in self._messages]

    def user(self, text: str) -> Conversation:
        self._messages.append({"role": "user", "content": text})
        return self

    def assistant(self, text: str) -> Conversation:
        """Add an assistant turn by hand (replaying a conversation)."""
        self._messages.append({"role": "assistant", "content": text})
        return self

    def generate(self, params: SamplingParams | None = None) -> Result:
        """The reply to the conversation so far, appended to it; GenerationError on failure."""
        [result] = generate_all([self], params)
        if result.error is not None:
            raise GenerationError(result.error)
        return result

    def fork(self, k: int = 2) -> list[Conversation]:
        """k independent conversations with copies of the conversation so far (see the module
        docstring for how they share its pages)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"fork needs a positive number of sessions, got {k!r}")
        return [Conversation(self.backend, messages=self._messages) for _ in range(k)]

    def __repr__(self) -> str:
        return f"Conversation({len(self._messages)} messages on {type(self.backend).__name__})"


def generate_all(sessions: Sequence[Conversation], params: SamplingParams | None = None) -> list[Result]:
    """Generate the next reply of every session together: one batch in process (so forks share
    their common pages while they run), concurrent requests over HTTP. Each successful reply
    is appended to its session; a failed one is reported on its Result and appends nothing."""
    sessions = list(sessions)
    if not sessions:
        return []
    params = params or SamplingParams()
    if params.n != 1:
        raise ValueError(f"a session takes one reply per turn (n=1), got n={params.n}; fork(n) the session instead")
    backend = sessions[0].backend
    if any(s.backend.identity != backend.identity for s in sessions[1:]):
        raise ValueError("generate_all needs sessions on the same backend")
    results = backend.generate([Prompt(messages=s.messages) for s in sessions], params)
    for session, result in zip(sessions, results):
        if result.ok:
            session.assistant(result.text)
    return results


# The SDK's old name for a Conversation, kept for callers written against it (deprecated): a
# "session" is the engine's named conversation of a key (engine/sessions.py, SessionRef).
Session = Conversation
