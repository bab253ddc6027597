"""Exact continuation over HTTP: where a route hands its finished chat and Messages outputs, each
complete reply remembered under the API key's owner (Tenants.owner) and the request's cache
partition in the server's `ReplyMap` (radixkv.prompts.replies, which also encodes conversations
with the replies spliced back).
"""

from __future__ import annotations

from radixkv.engine.request_output import RequestOutput
from radixkv.prompts.replies import ReplyMap


class ReplyCollector:
    """Where a route hands its finished outputs: each complete reply remembered in the map
    under its owner and the request's partition (nothing with continuation off)."""

    def __init__(self, replies: ReplyMap | None, owner: str | None, salt: str | None) -> None:
        self._replies, self._owner, self._salt = replies, owner, salt

    def finished(self, final: RequestOutput) -> None:
        if self._replies is None:
            return
        for output in final.outputs:
            if output.finish_reason is not None and output.finish_reason != "abort":
                self._replies.remember(self._owner, output.text, output.token_ids, salt=self._salt)
