"""Tenants: who may call the server (bearer API keys), which prefix-cache partition each
caller's requests use (cache salts, HMACs of the key and the request's cache_salt), and the one
owner id per key that every per-tenant cap (retention, pins, stored responses) counts against.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from radixkv.config import default_cache_dir
from radixkv.private_files import private_secret
from radixkv.server.errors import APIError

# The owner of every caller when the server has no keys: one tenant, one set of caps.
ANONYMOUS_OWNER = "anonymous"
# Mixed into an owner id's HMAC, so no owner id ever equals a cache salt (both are HMACs of the
# key under the same secret).
_OWNER_LABEL = b"radixkv owner\x00"

# Where `radixkv serve` also reads keys, so none has to be on the command line (which every
# user of the machine can read in the process list): comma- or newline-separated.
API_KEYS_ENV = "RADIXKV_API_KEYS"
TENANT_SECRET_BYTES = 32
ADMIN_KEYS_ENV = "RADIXKV_ADMIN_KEYS"


def load_api_keys(
    keys: Sequence[str] | None,
    key_file: str | Path | None = None,
    environ: Mapping[str, str] = os.environ,
    env_name: str = API_KEYS_ENV,
) -> list[str]:
    """The accepted keys from the command line, a file (one per line; blank lines and '#'
    comments skipped) and the environment variable `env_name` ($RADIXKV_API_KEYS; the admin
    keys come from $RADIXKV_ADMIN_KEYS the same way), in that order, without duplicates."""
    found = list(keys or [])
    if key_file is not None:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    found += [k.strip() for k in environ.get(env_name, "").replace("\n", ",").split(",") if k.strip()]
    return list(dict.fromkeys(found))


class Tenants:
    """Bearer-key checks, cache salts and owner ids: each key (and each cache_salt within it)
    gets its own prefix-cache partition, so no tenant can hit, or time, another's cached
    prefixes; each key is one owner, so a cache_salt never buys another share of a cap.

    Salts are HMACs under a per-process secret: a raw key never enters the engine."""

    def __init__(
        self, api_keys: Sequence[str] | None, secret: bytes | None = None, admin_keys: Sequence[str] | None = None
    ) -> None:
        # An admin key is an API key too (its own tenant), that may also run admin operations
        # (POST /v1/cache/flush).
        self._admin_keys = [key.encode() for key in admin_keys or []]
        self._keys = [key.encode() for key in api_keys or []] + self._admin_keys
        if any(not key for key in self._keys):
            raise ValueError("an API key must not be empty")
        self._secret = secret or secrets.token_bytes(32)

    @property
    def auth_required(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> bytes | None:
        """The caller's key (None when auth is off); APIError 401 if it is missing or wrong.
        The key comes as `Authorization: Bearer <key>` or as `x-api-key` (Anthropic's clients):
        the same keys, the same cache partition."""
        if not self._keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        candidate = token.strip().encode() if scheme.lower() == "bearer" else b""
        if api_key is not None and not candidate:
            candidate = api_key.strip().encode()
        # Compare against every key, always, so timing tells nothing about which one matched.
        matched = None
        for key in self._keys:
            if hmac.compare_digest(candidate, key):
                matched = key
        if matched is None:
            raise APIError(
                401,
                "missing or incorrect API key; send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return matched

    def authenticate_headers(self, headers: Mapping[str, str]) -> bytes | None:
        """`authenticate` on a request's headers: every route takes the key both ways."""
        return self.authenticate(headers.get("authorization"), api_key=headers.get("x-api-key"))

    def require_admin(self, key: bytes | None) -> None:
        """APIError 403 unless `key` (an authenticated caller's) is an admin key; with no admin
        key configured, nobody is one."""
        if key is None or not any(hmac.compare_digest(key, admin) for admin in self._admin_keys):
            raise APIError(403, "this operation needs an admin key (serve --admin-key)", code="permission_denied")

    def owner(self, key: bytes | None) -> str:
        """The caller's owner id: one per API key, whatever cache_salt its requests carry, so a
        key that rotates salts still has one retention cap, one pin cap and one store of
        responses. Stable across restarts when the secret is (a disk tier's retentions keep
        their owner); a raw key never leaves this class."""
        if key is None:
            return ANONYMOUS_OWNER
        return hmac.new(self._secret, _OWNER_LABEL + key, hashlib.sha256).hexdigest()[:32]

    def session_namespace(self, salt: str | None) -> str | None:
        """The namespace of a request's session keys within its owner (SessionRef.namespace).
        With keys, none: a key is its own owner, whatever cache_salt it sends. Without keys
        every caller is one owner (one set of caps), and a session key alone would let one
        caller resume, supersede or end another's turn by naming the same key; the cache
        partition (cache_salt) a keyless caller chooses sets its session keys apart too."""
        return None if self.auth_required else salt

    def sibling_salts(self, key: bytes | None, request_salt: str | None) -> tuple[str | None, ...]:
        """The partitions of the same owner a cache report may name as holding what a request
        missed (another_partition): the key's own default partition, for a request that names
        a cache_salt. The key's other cache_salts are not remembered (nothing is stored per
        tenant for reports), and another key's partition is never named."""
        return (self.cache_salt(key, None),) if request_salt is not None else ()

    def cache_salt(self, key: bytes | None, request_salt: str | None) -> str | None:
        if key is None and request_salt is None:
            return None
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (key or b"", (request_salt or "").encode()):
            mac.update(len(part).to_bytes(8, "little") + part)  # length-prefixed: no ambiguity
        mac.update(b"\x01" if request_salt is not None else b"\x00")
        return mac.hexdigest()[:32]


def persistent_secret(path: Path) -> bytes:
    """The tenant-salt secret kept in an owner-only file (made on first use, atomically), so
    cache salts stay the same across restarts and a disk tier's blocks stay reachable for their
    tenants. Keep it outside the disk tier's directory (default_tenant_secret_path): whoever
    reads it can compute any key's salt. OSError where the file or its folder is not private."""
    return private_secret(Path(path).expanduser(), TENANT_SECRET_BYTES)


def default_tenant_secret_path() -> Path:
    """Where `radixkv serve` keeps the tenant secret unless told (--tenant-secret-file)."""
    return default_cache_dir() / "tenant_secret"
