"""The scheduler's answer to CacheTreeReq: a summary of its radix tree, with a request's path marked.

A path can be marked for a request that is running or finished recently: `RecentRequests` remembers the
namespace and tokens of the last finished requests (bounded in count and tokens), since the tree keeps their
KV long after the scheduler forgot the request itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional

from radixserve.radix_cache.tree_summary import namespace_name, summarize_tree
from radixserve.runtime.wire.cache_tree import CacheTreeReq, CacheTreeSummary, RequestPath

if TYPE_CHECKING:
    from radixserve.scheduler.req import Req

RECENT_REQUESTS = 1024
RECENT_TOKENS = 2_000_000


class RecentRequests:
    """rid -> (namespace, token ids) of the most recently finished requests; the oldest go first."""

    def __init__(self, max_requests: int = RECENT_REQUESTS, max_tokens: int = RECENT_TOKENS) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, tuple[tuple, list[int]]] = OrderedDict()
        self._num_tokens = 0

    def record(self, req: "Req") -> None:
        self._forget(req.rid)
        token_ids = req.all_ids
        self._entries[req.rid] = (req.namespace, token_ids)
        self._num_tokens += len(token_ids)
        while self._entries and (len(self._entries) > self.max_requests or self._num_tokens > self.max_tokens):
            self._forget(next(iter(self._entries)))

    def get(self, rid: str) -> Optional[tuple[tuple, list[int]]]:
        return self._entries.get(rid)

    def _forget(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._num_tokens -= len(entry[1])


def cache_tree_summary(msg: CacheTreeReq, cache: Any, allocator: Any, reqs: dict[str, "Req"],
                       recent: RecentRequests) -> CacheTreeSummary:
    """The summary `msg` asks for, of `cache` (over `allocator`'s slots), with the path of a request among
    `reqs` (not yet released) or `recent` (finished). A rid that is unknown, or whose namespace `msg` does not
    select, marks nothing, so the answer does not tell whether another tenant used that rid."""
    running: Optional["Req"] = reqs.get(msg.rid) if msg.rid else None
    path_tokens = (running.namespace, running.all_ids) if running is not None else None
    if path_tokens is None and msg.rid:
        path_tokens = recent.get(msg.rid)
    namespaces, node_ids, cached = summarize_tree(
        cache, msg.namespace_prefix, msg.namespace, msg.max_depth, msg.max_nodes, msg.with_token_ids,
        path_tokens)
    path = None
    if path_tokens is not None and any(tree.name == namespace_name(path_tokens[0]) for tree in namespaces):
        path = RequestPath(rid=msg.rid or "", namespace=namespace_name(path_tokens[0]), node_ids=node_ids,
                           cached_tokens=cached, num_tokens=len(path_tokens[1]), running=running is not None)
    return CacheTreeSummary(time=time.time(), page_size=allocator.page_size, total_slots=allocator.size,
                            namespaces=namespaces, path=path)
