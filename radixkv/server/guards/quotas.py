"""Fair share per API key: how many engine requests and sequences each key has in flight, and
the 429 (with Retry-After) for a key past its share, so one flooding key cannot fill the
engine's queue and batch while the others wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from radixkv.server.errors import APIError, rate_limited

# Seconds a refused client is told to wait: requests usually finish within a few steps.
_RETRY_AFTER_S = 1


@dataclass(slots=True)
class _Usage:
    requests: int = 0
    seqs: int = 0


class Lease:
    """One submission's share of its key's quota; released once, when its requests end."""

    def __init__(self, quotas: KeyQuotas, key: bytes | None, requests: int, seqs: int) -> None:
        self._quotas, self._key, self._requests, self._seqs = quotas, key, requests, seqs
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._quotas._give_back(self._key, self._requests, self._seqs)


class KeyQuotas:
    """In-flight requests and sequences per key (None: the anonymous caller, one bucket).
    Touched from the event loop and from worker threads, hence the lock."""

    def __init__(self, max_requests: int, max_seqs: int) -> None:
        self.max_requests = max_requests
        self.max_seqs = max_seqs
        self._usage: dict[bytes | None, _Usage] = {}
        self._lock = threading.Lock()

    def check_fits(self, requests: int, seqs: int, param: str) -> None:
        """APIError 400 for a submission larger than a key's whole share: waiting cannot help it."""
        if requests > self.max_requests or seqs > self.max_seqs:
            raise APIError(
                400,
                f"this request makes {requests} engine requests ({seqs} sequences); the server allows "
                f"{self.max_requests} requests and {self.max_seqs} sequences per key at once; split it",
                param=param,
                code="request_too_large",
            )

    def check_room(self, key: bytes | None) -> None:
        """APIError 429 when `key` has no room for one more request: called before its body is
        read, so a flooding key's excess costs the server no parse, template or tokenizer."""
        with self._lock:
            usage = self._usage.get(key)
            if usage is not None and usage.requests >= self.max_requests:
                raise self._full(usage)

    def acquire(self, key: bytes | None, requests: int, seqs: int) -> Lease:
        """A lease on `requests` engine requests of `seqs` sequences, or APIError 429."""
        with self._lock:
            usage = self._usage.setdefault(key, _Usage())
            if usage.requests + requests > self.max_requests or usage.seqs + seqs > self.max_seqs:
                raise self._full(usage)
            usage.requests += requests
            usage.seqs += seqs
        return Lease(self, key, requests, seqs)

    def _full(self, usage: _Usage) -> APIError:
        return rate_limited(
            f"this API key has {usage.requests} requests ({usage.seqs} sequences) in flight; the server allows "
            f"{self.max_requests} requests and {self.max_seqs} sequences per key at once; retry later",
            _RETRY_AFTER_S,
        )

    def in_flight(self, key: bytes | None) -> tuple[int, int]:
        with self._lock:
            usage = self._usage.get(key, _Usage())
            return usage.requests, usage.seqs

    def _give_back(self, key: bytes | None, requests: int, seqs: int) -> None:
        with self._lock:
            usage = self._usage[key]
            usage.requests -= requests
            usage.seqs -= seqs
            if usage.requests == 0:
                del self._usage[key]
