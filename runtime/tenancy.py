"""API keys -> callers: a tenant id, and whether the caller may administer the server.

`--api-key KEY`: one key, one tenant; requests carry no tenant id (the default cache namespace), but every
protected route needs the key. `--tenants-file FILE`: a JSON object mapping API keys to tenant ids, e.g.
`{"sk-alpha": "alpha", "sk-beta": "beta"}`; the tenant id becomes part of each request's cache namespace,
so tenants never share cached prefixes. Without either, the server is open and everyone shares the default
namespace. A tenant may also be given as an object with its fair-share weight (docs/fair-share.md), e.g.
`{"sk-alpha": {"tenant": "alpha", "weight": 2}, "sk-beta": "beta"}`; a tenant's weight defaults to 1, and two
keys of one tenant must agree on it.

Administration (`/flush_cache`, `/metrics`, the whole of `/get_server_info`) acts on or shows every tenant:
- `--admin-api-key KEY` (SGLang's name): only that key may; it also works on every other route (default
  namespace);
- without it, the caller may administer when the server has no tenants to keep apart: an open server, or a
  single `--api-key` (its holder is the operator). With a tenants file and no admin key, nobody may.

The caller is derived here, from the key, and never read from the request body. Keys are compared through
their SHA-256 digests so the comparison's timing reveals nothing about a valid key. A missing or wrong key raises
AuthenticationError, which the HTTP server answers with a 401 (runtime/http/state.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Optional


class AuthenticationError(Exception):
    """A key is required and missing (`code` "missing_api_key") or matches no tenant ("invalid_api_key")."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


DEFAULT_TENANT_WEIGHT = 1.0


def load_tenants_file(path: str) -> dict[str, str]:
    """Read and check a tenants file: a JSON object of non-empty API key -> non-empty tenant id."""
    return load_tenants(path)[0]


def load_tenants(path: str) -> tuple[dict[str, str], dict[str, float]]:
    """Read and check a tenants file: (API key -> tenant id, tenant id -> fair-share weight)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not data:
        raise ValueError(f"tenants file {path}: expected a non-empty JSON object mapping API keys to tenant ids")
    tenants: dict[str, str] = {}
    weights: dict[str, float] = {}
    for key, entry in data.items():
        weight = DEFAULT_TENANT_WEIGHT
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"tenant", "weight"})
            if unknown:
                raise ValueError(f"tenants file {path}: unknown field(s) {unknown} for a tenant "
                                 "(an entry is a tenant id, or {\"tenant\": id, \"weight\": number})")
            weight = entry.get("weight", DEFAULT_TENANT_WEIGHT)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise ValueError(f"tenants file {path}: weight must be a positive number, got {weight!r}")
            entry = entry.get("tenant")
        tenant = entry
        if not isinstance(key, str) or not key or not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenants file {path}: keys and tenant ids must be non-empty strings")
        if "/" in tenant:  # server info names namespaces "tenant:<id>/salt:<salt>"
            raise ValueError(f"tenants file {path}: tenant id {tenant!r} must not contain '/'")
        if weights.get(tenant, weight) != weight:
            raise ValueError(f"tenants file {path}: tenant {tenant!r} has two weights ({weights[tenant]} and "
                             f"{weight}); give it one")
        tenants[key] = tenant
        weights[tenant] = float(weight)
    return tenants, weights


@dataclass(frozen=True)
class Caller:
    tenant: Optional[str]  # None: the default namespace
    is_admin: bool


class TenantResolver:
    """Maps the `Authorization: Bearer <key>` header of a request to its caller (see the module docstring)."""

    def __init__(self, keys_to_tenants: Optional[dict[str, Optional[str]]] = None,
                 admin_api_key: Optional[str] = None, weights: Optional[dict[str, float]] = None) -> None:
        self._tenant_by_digest = {_digest(k): t for k, t in (keys_to_tenants or {}).items()}
        self._weights = dict(weights or {})
        self._admin_digest = _digest(admin_api_key) if admin_api_key else None
        self.has_tenants = any(t is not None for t in self._tenant_by_digest.values())
        self.tenant_ids = frozenset(t for t in self._tenant_by_digest.values() if t is not None)

    @classmethod
    def from_server_args(cls, api_key: Optional[str], tenants_file: Optional[str],
                         admin_api_key: Optional[str] = None) -> "TenantResolver":
        if api_key is not None and tenants_file is not None:
            raise ValueError("give either api_key or tenants_file, not both")
        if admin_api_key is not None and not admin_api_key:
            raise ValueError("admin_api_key must not be empty")
        keys: dict[str, Optional[str]] = {}
        weights: dict[str, float] = {}
        if tenants_file is not None:
            tenants, weights = load_tenants(tenants_file)
            keys = dict(tenants)
        elif api_key is not None:
            if not api_key:
                raise ValueError("api_key must not be empty")
            keys = {api_key: None}
        if admin_api_key is not None and admin_api_key in keys:
            raise ValueError("admin_api_key must differ from every tenant's API key")
        return cls(keys, admin_api_key, weights)

    def weight_of(self, tenant: Optional[str]) -> float:
        """A tenant's fair-share weight (1 for the default namespace and tenants the file gives none)."""
        return self._weights.get(tenant, DEFAULT_TENANT_WEIGHT) if tenant else DEFAULT_TENANT_WEIGHT

    @property
    def auth_required(self) -> bool:
        """Whether every protected route needs a key (an admin key alone guards only administration)."""
        return bool(self._tenant_by_digest)

    def caller(self, authorization: Optional[str]) -> Caller:
        """Who is calling; raises AuthenticationError when a key is required and missing or wrong."""
        if self._is_admin_key(authorization):
            return Caller(None, is_admin=True)
        tenant = self.tenant_for(authorization)
        return Caller(tenant, is_admin=self._admin_digest is None and not self.has_tenants)

    def _is_admin_key(self, authorization: Optional[str]) -> bool:
        key = _bearer_token(authorization)
        return key is not None and self._admin_digest is not None and hmac.compare_digest(_digest(key),
                                                                                          self._admin_digest)

    def tenant_for(self, authorization: Optional[str]) -> Optional[str]:
        """The caller's tenant id; raises AuthenticationError when a key is required and missing or wrong."""
        if not self.auth_required or self._is_admin_key(authorization):
            return None
        key = _bearer_token(authorization)
        if key is None:
            raise AuthenticationError(
                "You didn't provide an API key. Send it in the Authorization header as 'Bearer <key>'.",
                code="missing_api_key")
        presented = _digest(key)
        for digest, tenant in self._tenant_by_digest.items():
            if hmac.compare_digest(digest, presented):
                return tenant
        raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")


def _bearer_token(authorization: Optional[str]) -> Optional[str]:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
