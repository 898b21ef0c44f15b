"""Retained sessions: a conversation's cached prefix kept from eviction for a while (`prompt_cache_key` with
`prompt_cache_retention`), so an agent's next turn finds it after a tool call or think time under KV pressure.

A session is named by its cache namespace (tenant, salt, adapter) and the client's key, so a tenant can neither see
nor extend another tenant's session: the same key in two namespaces is two sessions. When a request of a session
finishes, its tokens (prompt and output, as the tree holds them) are retained until `now + seconds` through the
cache's `retain_prefix`:
- on a device-only cache the session locks the path of that prefix (`inc_lock_ref`), exactly as a running request
  does, so eviction passes it by and the admission budget (free + evictable) leaves it alone. Retained tokens are
  then counted as protected; an idle scheduler has `protected == retained_size()`;
- with the host tier (`--enable-hierarchical-cache`) the path is pinned on the host instead (hiradix.py): it gets a
  host copy at once and host eviction passes it by, while the device demotes it as it does any unlocked prefix.
  Running requests keep the whole device, and the session's next turn loads its prefix back from host memory.
  Quotas are then shares of the host tier, and `retained_size()` (device tokens locked) is 0.
A later turn of the session moves the retention to its longer prefix and renews the expiry; `expire` releases what
has run out.

Quotas. A tenant retains at most `tenant_quota` tokens, and all tenants together at most `total_quota` (so requests
always have room to run). A retention that would exceed either first releases the same tenant's sessions that
expire soonest; when that cannot make room (the session alone is longer than the quota, or the other tenants' fill
the total), it is not retained: one tenant never releases another's session. A session's size is its whole prefix,
so sessions sharing a prefix count it once each (quotas err on the safe side).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from radixserve.radix_cache.base import PrefixCache

SessionKey = tuple[tuple[str, ...], str]  # (cache namespace, the client's prompt_cache_key)


def tenant_of_namespace(namespace: tuple[str, ...]) -> Optional[str]:
    return namespace[0][len("tenant:"):] if namespace and namespace[0].startswith("tenant:") else None


@dataclass
class Retained:
    node: Any  # the cache's handle of the kept prefix (its last node)
    num_tokens: int
    expires_at: float
    tenant: Optional[str]


@dataclass
class RetentionStats:
    retained_sessions: int
    retained_tokens: int  # sum over sessions (a prefix shared by two sessions counts twice)
    tokens_by_tenant: dict[str, int]  # tenant ("" for none) -> retained tokens
    expired_sessions: int  # released at expiry, since start
    refused_sessions: int  # not retained: longer than the quota alone
    displaced_sessions: int  # released early to make room for another within a quota
    next_expiry_in: Optional[float]  # seconds until the soonest expiry


class RetainedSessions:
    def __init__(self, cache: PrefixCache, tenant_quota: int, total_quota: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tenant_quota < 0 or total_quota < 0:
            raise ValueError("retention quotas are token counts >= 0")
        self.cache = cache
        self.tenant_quota = tenant_quota
        self.total_quota = total_quota
        self.clock = clock
        self._sessions: dict[SessionKey, Retained] = {}
        self._expired = self._refused = self._displaced = 0

    def retain(self, namespace: tuple[str, ...], session: str, token_ids: list[int], seconds: float) -> int:
        """Retain the cached prefix of `token_ids` for `session` until `seconds` from now; returns the tokens
        retained (0 when nothing of it is cached or it exceeds the quota alone). Releases the session's earlier
        prefix first: a session retains one prefix, its latest."""
        key = (namespace, session)
        self.release(key)
        tenant = tenant_of_namespace(namespace)
        kept = self.cache.retain_prefix(token_ids, namespace)
        if kept is None:
            return 0
        node, num_tokens = kept
        if not self._make_room(num_tokens, tenant):
            self.cache.release_prefix(node)
            self._refused += 1
            return 0
        self._sessions[key] = Retained(node, num_tokens, self.clock() + seconds, tenant)
        return num_tokens

    def _make_room(self, num_tokens: int, tenant: Optional[str]) -> bool:
        """Release `tenant`'s soonest-expiring sessions until `num_tokens` more fit both quotas; False when they
        cannot (another tenant's sessions are never released for it)."""
        total_used = sum(r.num_tokens for r in self._sessions.values())
        own = sorted(((key, r) for key, r in self._sessions.items() if r.tenant == tenant),
                     key=lambda item: item[1].expires_at)
        tenant_used = sum(r.num_tokens for _, r in own)

        def fits() -> bool:
            return tenant_used + num_tokens <= self.tenant_quota and total_used + num_tokens <= self.total_quota

        if num_tokens > self.tenant_quota or total_used - tenant_used + num_tokens > self.total_quota:
            return False  # releasing all of the tenant's own would not make room
        for key, retained in own:
            if fits():
                break
            self.release(key)
            self._displaced += 1
            total_used -= retained.num_tokens
            tenant_used -= retained.num_tokens
        return fits()

    def release(self, key: SessionKey) -> bool:
        retained = self._sessions.pop(key, None)
        if retained is None:
            return False
        self.cache.release_prefix(retained.node)
        return True

    def expire(self) -> int:
        """Release every session whose time is up; returns how many."""
        if not self._sessions:
            return 0
        now = self.clock()
        expired = [key for key, retained in self._sessions.items() if retained.expires_at <= now]
        for key in expired:
            self.release(key)
        self._expired += len(expired)
        return len(expired)

    def release_all(self) -> None:
        """Before a flush of the tree: nothing stays retained."""
        for key in list(self._sessions):
            self.release(key)

    def retained_size(self) -> int:
        """Device tokens the sessions lock, a shared prefix counted once (for the idle check); 0 when the cache keeps
        retained prefixes on its host tier."""
        if not self.cache.retains_on_device:
            return 0
        seen: set[int] = set()
        total = 0
        for retained in self._sessions.values():
            node = retained.node
            while node.key and id(node) not in seen:
                seen.add(id(node))
                total += len(node.key)
                node = node.parent
        return total

    def stats(self) -> RetentionStats:
        by_tenant: dict[str, int] = {}
        for retained in self._sessions.values():
            by_tenant[retained.tenant or ""] = by_tenant.get(retained.tenant or "", 0) + retained.num_tokens
        soonest = min((r.expires_at for r in self._sessions.values()), default=None)
        return RetentionStats(len(self._sessions), sum(by_tenant.values()), by_tenant, self._expired, self._refused,
                              self._displaced, None if soonest is None else max(0.0, soonest - self.clock()))

    def __len__(self) -> int:
        return len(self._sessions)
