"""One answer from the N data-parallel replicas' answers to a control request (flush, server info, cache tree).

The controller (runtime/data_parallel/) sends a control request to every replica; each replies on its own, and
the TokenizerManager merges the replies once all N are in. Server info: counters and memory figures are summed,
rates recomputed from the summed counters (hit rate, token usage), the model's facts taken once, and each
replica's own load listed under `replicas`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.runtime.wire.cache_tree import CacheTreeReqOutput
from radixserve.runtime.wire.lora import LoRAAdapterReqOutput
from radixserve.runtime.wire.messages import FlushCacheReqOutput, GetServerInfoReqOutput

# Server-info counters that add up across replicas (the scheduler's stats and queue sizes).
_ADDITIVE = ("num_requests", "num_finished", "num_aborted", "num_retractions", "prefill_tokens_computed",
             "decode_steps", "extend_batches", "mixed_batches", "partial_chunks", "forced_syncs",
             "generated_tokens", "gen_throughput", "num_running_reqs", "num_queued_reqs",
             "max_total_num_tokens", "max_running_requests")


def merge_replies(replies: list[Any]) -> Any:
    first = replies[0]
    if len(replies) == 1:
        return first
    if isinstance(first, FlushCacheReqOutput):
        refused = [reply.message for reply in replies if not reply.success]
        return FlushCacheReqOutput(first.rpc_id, not refused, "; ".join(dict.fromkeys(refused)))
    if isinstance(first, GetServerInfoReqOutput):
        return GetServerInfoReqOutput(first.rpc_id, merge_server_info([reply.info for reply in replies]))
    if isinstance(first, LoRAAdapterReqOutput):  # every replica loads (unloads) the adapter: all must succeed
        failed = [reply for reply in replies if not reply.success]
        return failed[0] if failed else first
    if isinstance(first, CacheTreeReqOutput):
        return CacheTreeReqOutput(first.rpc_id, merge_cache_trees([reply.summary for reply in replies]))
    raise TypeError(f"no merge for {type(first).__name__}")


def merge_server_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    infos = sorted(infos, key=lambda info: info.get("dp_rank", 0))
    merged = dict(infos[0])
    for key in _ADDITIVE:
        if key in merged:
            merged[key] = sum(info.get(key) or 0 for info in infos)
    merged["new_token_ratio"] = sum(info.get("new_token_ratio", 0.0) for info in infos) / len(infos)
    merged["memory"] = _sum_numbers([info.get("memory") or {} for info in infos])
    memory = merged["memory"]
    total = memory.get("total_tokens") or 0
    used = total - (memory.get("free_tokens") or 0) - (memory.get("evictable_tokens") or 0)
    merged["token_usage"] = used / total if total else 0.0
    merged["cache"] = _merge_cache([info.get("cache") or {} for info in infos])
    merged["dp_size"] = len(infos)
    merged["replicas"] = [_replica_view(info) for info in infos]
    merged.pop("dp_rank", None)
    return merged


def _replica_view(info: dict[str, Any]) -> dict[str, Any]:
    cache = info.get("cache") or {}
    return {"dp_rank": info.get("dp_rank", 0), "num_running_reqs": info.get("num_running_reqs"),
            "num_queued_reqs": info.get("num_queued_reqs"), "token_usage": info.get("token_usage"),
            "gen_throughput": info.get("gen_throughput"), "memory": info.get("memory"),
            "cache_hit_rate": cache.get("hit_rate"), "matched_tokens": cache.get("matched_tokens"),
            "queried_tokens": cache.get("queried_tokens"),
            **({"avg_spec_accept_length": info["avg_spec_accept_length"]} if "avg_spec_accept_length" in info else {})}


def _merge_cache(caches: list[dict[str, Any]]) -> dict[str, Any]:
    merged = _sum_numbers(caches)
    _recompute_hit_rates(merged)
    if "tree" in merged:
        _recompute_hit_rates(merged["tree"])
    for counters in (merged.get("namespaces") or {}).values():
        _recompute_hit_rates(counters)
    return merged


def _recompute_hit_rates(counters: dict[str, Any]) -> None:
    queried = counters.get("queried_tokens") or 0
    counters["hit_rate"] = (counters.get("matched_tokens") or 0) / queried if queried else 0.0


def _sum_numbers(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key: numbers summed, nested dicts merged the same way, anything else taken from the first."""
    merged: dict[str, Any] = {}
    for source in dicts:
        for key, value in source.items():
            if key not in merged:
                merged[key] = _sum_numbers([value]) if isinstance(value, dict) else value
            elif isinstance(value, dict) and isinstance(merged[key], dict):
                merged[key] = _sum_numbers([merged[key], value])
            elif _is_number(value) and _is_number(merged[key]):
                merged[key] = merged[key] + value
    return merged


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
