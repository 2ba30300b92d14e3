"""API keys and tenants: each key belongs to a tenant, and a tenant's requests share a prefix cache with nobody else.

Keys come from --api-key (tenant "default") and --api-key-file, one `TENANT KEY` pair a line ('#' starts a comment).
Only a keyed digest of each key is kept in memory, and no key is ever logged or echoed in an error: errors about the
file name its line number. A tenant's name is salted into every block key of its requests (core/prefix_cache), so
its KV blocks, on the device and in a shared disk or Redis store, are never served to another tenant.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from hashlib import blake2b
from types import MappingProxyType

from fastapi import Request

from deepinfer.sampling_params import SamplingParams
from deepinfer.server.protocol import APIError

DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_BEARER = "bearer "


def _digest(key: str) -> bytes:
    return blake2b(key.encode(), digest_size=32, person=b"deepinfer-apikey").digest()


@dataclass(frozen=True)
class Tenants:
    """API key digest -> tenant name. Empty: the server is open (no key needed, no tenant salt)."""

    _by_digest: Mapping[bytes, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_keys(cls, pairs: list[tuple[str, str]]) -> Tenants:
        """(tenant, key) pairs; one key may not belong to two tenants."""
        table: dict[bytes, str] = {}
        for number, (tenant, key) in enumerate(pairs, 1):
            if not _TENANT_NAME.fullmatch(tenant):
                raise ValueError(f"API key #{number}: tenant name {tenant!r} must be 1-64 characters of letters, "
                                 f"digits, '.', '_' or '-', starting with a letter or digit")
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"API key #{number} (tenant {tenant!r}) is empty or contains whitespace")
            digest = _digest(key)
            if table.get(digest, tenant) != tenant:
                raise ValueError(f"API key #{number} is given to two tenants, {table[digest]!r} and {tenant!r}")
            table[digest] = tenant
        return cls(MappingProxyType(table))

    @classmethod
    def load(cls, api_key: str | None = None, key_file: str | None = None) -> Tenants:
        pairs = [(DEFAULT_TENANT, api_key)] if api_key is not None else []
        if key_file is not None:
            pairs += read_key_file(key_file)
        return cls.from_keys(pairs)

    @property
    def required(self) -> bool:
        return bool(self._by_digest)

    @property
    def names(self) -> list[str]:
        return sorted(set(self._by_digest.values()))

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_of(self, authorization: str) -> str | None:
        """The tenant of an 'Authorization: Bearer KEY' header value; None for a missing or unknown key."""
        if not authorization.lower().startswith(_BEARER):
            return None
        return self._by_digest.get(_digest(authorization[len(_BEARER):].strip()))


def read_key_file(path: str) -> list[tuple[str, str]]:
    """`TENANT KEY` lines; raises ValueError naming the line (never its key)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the API key file {path!r}: {type(e).__name__}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'TENANT KEY' (two fields), got {len(parts)} field(s)")
        pairs.append((parts[0], parts[1]))
    if not pairs:
        raise ValueError(f"the API key file {path!r} holds no keys")
    return pairs


def tenant_salt(tenant: str) -> str:
    """A tenant's cache salt prefix: hex, so it cannot contain the '|' that ends it (no tenant can forge another's)."""
    return blake2b(tenant.encode(), digest_size=16, person=b"deepinfer-tenant").hexdigest()


def salted(params: SamplingParams, tenant: str | None) -> SamplingParams:
    """The request's own cache_salt stays a partition inside its tenant's."""
    if tenant is None:
        return params
    return params.replace(cache_salt=f"{tenant_salt(tenant)}|{params.cache_salt or ''}")


def auth_checker(tenants: Tenants) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 without a known key; records the tenant on request.state."""

    def check(request: Request) -> None:
        request.state.tenant = None
        if not tenants.required:
            return
        tenant = tenants.tenant_of(request.headers.get("authorization", ""))
        if tenant is None:
            raise APIError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        request.state.tenant = tenant

    return check
