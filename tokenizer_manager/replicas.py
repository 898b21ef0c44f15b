"""One answer from the N data-parallel replicas' answers to a control request (flush, server info, cache tree).

The controller (runtime/data_parallel/) sends a control request to every replica; each replies on its own, and
the TokenizerManager merges the replies once all N are in. Server info merges field by field (`ServerInfo.merge`,
runtime/wire/server_info.py: sums, rates recomputed from them, the shared configuration once, each replica's load
listed under `replicas`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.runtime.wire.cache_tree import CacheTreeReqOutput
from radixserve.runtime.wire.lora import LoRAAdapterReqOutput
from radixserve.runtime.wire.messages import FlushCacheReqOutput, GetServerInfoReqOutput
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.runtime.wire.weights import ControlReqOutput, GetWeightsByNameReqOutput


def merge_replies(replies: list[Any]) -> Any:
    first = replies[0]
    if len(replies) == 1:
        return first
    if isinstance(first, FlushCacheReqOutput):
        refused = [reply.message for reply in replies if not reply.success]
        return FlushCacheReqOutput(first.rpc_id, not refused, "; ".join(dict.fromkeys(refused)))
    if isinstance(first, GetServerInfoReqOutput):
        return GetServerInfoReqOutput(first.rpc_id, ServerInfo.merge([reply.info for reply in replies]))
    if isinstance(first, (ControlReqOutput, GetWeightsByNameReqOutput)):  # every replica acts: all must succeed
        failed = [reply for reply in replies if not reply.success]
        return failed[0] if failed else first
    if isinstance(first, LoRAAdapterReqOutput):  # every replica loads (unloads) the adapter: all must succeed
        failed = [reply for reply in replies if not reply.success]
        return failed[0] if failed else first
    if isinstance(first, CacheTreeReqOutput):
        return CacheTreeReqOutput(first.rpc_id, merge_cache_trees([reply.summary for reply in replies]))
    raise TypeError(f"no merge for {type(first).__name__}")


def merge_cache_trees(summaries: list[Any]) -> Any:
    """The replicas' namespaces side by side (each labelled with its replica, node ids made unique)."""
    namespaces, path, offset = [], None, 0
    for replica, summary in enumerate(summaries):
        for tree in summary.namespaces:
            nodes = [msgspec.structs.replace(node, id=node.id + offset,
                                             parent=node.parent + offset if node.parent >= 0 else -1)
                     for node in tree.nodes]
            namespaces.append(msgspec.structs.replace(tree, nodes=nodes, replica=replica))
        if path is None and summary.path is not None:
            path = msgspec.structs.replace(summary.path, node_ids=[i + offset for i in summary.path.node_ids])
        offset += max((node.id for tree in summary.namespaces for node in tree.nodes), default=-1) + 1
    first = summaries[0]
    return msgspec.structs.replace(first, namespaces=namespaces, path=path,
                                   total_slots=sum(summary.total_slots for summary in summaries))
