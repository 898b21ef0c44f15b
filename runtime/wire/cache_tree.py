"""The radix tree as others may see it: the CacheTreeReq RPC and the summary the scheduler answers with.

The summary is built in the scheduler process (radix_cache/tree_summary.py), where the tree lives, and travels
back like every other RPC reply (runtime/messages.py lists these types in its `Message` union). It never holds
the token ids of a namespace the request did not select: the HTTP layer selects the caller's own namespaces
through `namespace_prefix` (its tenant part), and asks for token ids only for those.

Light module: msgspec only, so every process may import it.
"""

from __future__ import annotations

import hashlib

import enum
from typing import Optional

import msgspec

MAX_SUMMARY_NODES = 5000  # per namespace; a summary is for drawing, not a dump of the tree
MAX_SUMMARY_DEPTH = 4096


class CacheTier(str, enum.Enum):
    """Where a node's KV lives. Only the device tier exists today; a host tier will add HOST."""

    DEVICE = "device"
    HOST = "host"


class CacheTreeReq(msgspec.Struct, tag=True):
    rpc_id: str
    # Only namespaces whose parts start with these (the caller's tenant part; () selects every namespace).
    namespace_prefix: tuple[str, ...] = ()
    namespace: Optional[str] = None  # only the namespace of this name ("default", or the parts joined by "/")
    max_depth: int = 0  # nodes deeper than this are folded into their ancestor's omitted counts; 0: no limit
    max_nodes: int = 200  # per namespace: the nodes that hold the most tokens x hits, with their ancestors
    with_token_ids: bool = False
    rid: Optional[str] = None  # a running or recently finished request whose path to mark

    def __post_init__(self) -> None:
        if not 1 <= self.max_nodes <= MAX_SUMMARY_NODES:
            raise ValueError(f"max_nodes must be in [1, {MAX_SUMMARY_NODES}], got {self.max_nodes}")
        if not 0 <= self.max_depth <= MAX_SUMMARY_DEPTH:
            raise ValueError(f"max_depth must be in [0, {MAX_SUMMARY_DEPTH}], got {self.max_depth}")


class CacheTreeNode(msgspec.Struct):
    id: int  # unique within one summary; ids of a namespace follow its depth-first order
    parent: int  # -1 under the namespace root
    depth: int  # 1 for a child of the namespace root
    tokens: int  # tokens in this node
    prefix_tokens: int  # tokens from the namespace root through the end of this node
    subtree_tokens: int  # tokens in this node and all its descendants, shown or not
    hits: int  # prefix matches that went through this node
    last_access: float  # Unix time of the last match or insert through this node
    lock_ref: int  # running requests holding this node (> 0: cannot be evicted)
    tier: CacheTier = CacheTier.DEVICE
    omitted_children: int = 0  # children not in the summary (folded by max_nodes or max_depth)
    omitted_tokens: int = 0  # tokens in the subtrees of those children
    token_ids: Optional[list[int]] = None  # only with `with_token_ids`


class NamespaceTree(msgspec.Struct):
    name: str
    num_nodes: int  # in the whole namespace, shown or not
    num_tokens: int
    num_top_level: int  # children of the namespace root
    locked_tokens: int
    queried_tokens: int  # cumulative prefix-match counters of the namespace (radix_cache/stats.py)
    matched_tokens: int
    inserted_tokens: int
    evicted_tokens: int
    hit_rate: float
    truncated: bool  # some nodes are folded into their ancestors' omitted counts
    nodes: list[CacheTreeNode] = []
    replica: Optional[int] = None  # the data-parallel replica whose tree this is (None without --dp-size)


class RequestPath(msgspec.Struct):
    rid: str
    namespace: str
    node_ids: list[int]  # the summary's nodes its tokens run through, top-down
    cached_tokens: int  # of its tokens, how many the tree holds now
    num_tokens: int  # its prompt and output tokens so far
    running: bool


class CacheTreeSummary(msgspec.Struct):
    time: float  # Unix time on the scheduler when the summary was taken
    page_size: int
    total_slots: int  # KV token slots of the device pool
    namespaces: list[NamespaceTree]
    path: Optional[RequestPath] = None  # the request `rid` named, when it is known and in a selected namespace


class CacheTreeReqOutput(msgspec.Struct, tag=True):
    rpc_id: str
    summary: CacheTreeSummary


def namespace_name(namespace: tuple[str, ...]) -> str:
    """A namespace as shown to people: "default", or its parts joined by "/", a salt as "salt#<digest>" (a salt
    is never listed, so nobody who reads statistics or the cache page can reuse another client's salt)."""
    if not namespace:
        return "default"
    parts = []
    for part in namespace:
        if part.startswith("salt:"):
            part = "salt#" + hashlib.sha256(part[len("salt:"):].encode("utf-8")).hexdigest()[:16]
        parts.append(part)
    return "/".join(parts)
