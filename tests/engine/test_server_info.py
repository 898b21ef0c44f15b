"""Server info as a typed report (runtime/wire/server_info.py): the JSON keys SGLang's clients read, the wire
codec, and the merge of data-parallel replicas' reports (sums, rates recomputed from the summed parts, the shared
configuration once, per-replica views), on reports of real schedulers and on hand-made ones where a rule needs
exact numbers. The metrics read the same report."""

from __future__ import annotations

import logging

import msgspec
import pytest

from radixserve.runtime.http.metrics import ServerMetrics
from radixserve.runtime.wire.cache_info import (
    CacheInfo, HiCacheInfo, LowerTierMemory, MemoryInfo, NamespaceCounters, TreeCounters,
)
from radixserve.runtime.wire.messages import GetServerInfoReqOutput, decode, encode
from radixserve.runtime.wire.server_info import (
    FairShareInfo, ModelInfo, SchedulerCounters, ServerInfo, SpecInfo, TenantShare, TensorParallelLayout,
)
from scheduler_driver import SchedulerDriver

# The keys of `/get_server_info` (and Engine.get_server_info()) for one scheduler, as SGLang's clients read them.
TOP_LEVEL_KEYS = {
    "context_len", "vocab_size", "max_total_num_tokens", "max_running_requests", "page_size", "eos_token_ids",
    "model_path", "device", "dtype", "attention_backend", "decode_attention_backend", "chunked_prefill_size",
    "schedule_policy",
    "overlap_schedule", "radix_cache", "hierarchical_cache", "sampling_backend", "tokenizer_path",
    "sampling_defaults", "lora_adapters", "lora_enabled", "dp_size", "request_limits", "pooling_kinds", "pooling_method", "labels", "is_generation",
    "weight_version", "retention", "num_requests", "num_finished",
    "num_aborted",
    "num_retractions", "prefill_tokens_computed", "decode_steps", "extend_batches", "mixed_batches",
    "partial_chunks", "forced_syncs", "generated_tokens", "gen_throughput", "memory", "cache", "num_running_reqs",
    "num_queued_reqs", "token_usage", "new_token_ratio", "tensor_parallel", "fair_share", "cascade_batches",
    "dp_rank",
}
CACHE_KEYS = {"hit_rate", "matched_tokens", "queried_tokens", "tree", "namespaces"}
TREE_KEYS = {"queried_tokens", "matched_tokens", "inserted_tokens", "evicted_tokens", "hit_rate",
             "dropped_namespaces"}
MEMORY_KEYS = {"total_tokens", "free_tokens", "evictable_tokens", "protected_tokens"}
REPLICA_KEYS = {"dp_rank", "num_running_reqs", "num_queued_reqs", "token_usage", "gen_throughput", "memory",
                "cache_hit_rate", "matched_tokens", "queried_tokens"}


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def scheduler_report(model_dir: str, prompts: dict[str, tuple[tuple[str, ...], list[int]]]) -> ServerInfo:
    """The report of a real scheduler after serving `prompts` (rid -> (namespace, token ids)), idle again."""
    driver = SchedulerDriver(model_dir, disable_overlap_schedule=True)
    for rid, (namespace, ids) in prompts.items():
        driver.submit(rid, ids, namespace=namespace, max_new_tokens=4)
        driver.run_until_idle()  # one at a time, so a later prompt finds the earlier one's prefix cached
    report = driver.server_report()
    driver.close()
    return report


def test_real_schedulers_reports_merge_field_by_field(tiny_llama):
    shared = list(range(10, 40))
    first = scheduler_report(tiny_llama, {"a": (("alpha",), shared + [1, 2]), "b": (("alpha",), shared + [3, 4])})
    second = scheduler_report(tiny_llama, {"c": (("beta",), list(range(50, 70))), "d": ((), [5, 6, 7])})
    assert first.cache.matched_tokens >= len(shared)  # the second alpha prompt hit the first one's prefix
    first, second = (msgspec.structs.replace(report, dp_rank=rank) for rank, report in enumerate((first, second)))

    merged = ServerInfo.merge([second, first])  # in any order: the replicas are listed by rank

    for name in SchedulerCounters.__struct_fields__:
        assert getattr(merged.counters, name) == getattr(first.counters, name) + getattr(second.counters, name)
    assert merged.counters.num_requests == 4
    for name in ("total_tokens", "free_tokens", "evictable_tokens", "protected_tokens"):
        assert getattr(merged.memory, name) == getattr(first.memory, name) + getattr(second.memory, name)
    assert merged.model.max_total_num_tokens == 2 * first.model.max_total_num_tokens
    assert merged.model.max_running_requests == 2 * first.model.max_running_requests
    assert merged.model.dp_size == 2 and merged.model.context_len == first.model.context_len
    assert merged.tensor_parallel == first.tensor_parallel
    # Rates from the summed parts, not the replicas' rates added or averaged.
    matched = first.cache.matched_tokens + second.cache.matched_tokens
    queried = first.cache.queried_tokens + second.cache.queried_tokens
    assert merged.cache.hit_rate == pytest.approx(matched / queried)
    assert merged.cache.hit_rate != pytest.approx(first.cache.hit_rate + second.cache.hit_rate)
    used = merged.memory.total_tokens - merged.memory.free_tokens - merged.memory.evictable_tokens
    assert merged.token_usage == pytest.approx(used / merged.memory.total_tokens)
    # Namespaces side by side (each replica served its own), the tree's counters summed.
    assert set(merged.cache.namespaces) == set(first.cache.namespaces) | set(second.cache.namespaces)
    for name in TreeCounters.__struct_fields__:
        assert getattr(merged.cache.tree, name) == getattr(first.cache.tree, name) + getattr(second.cache.tree, name)
    shares = merged.fair_share.tenants["default"]
    assert shares.tokens_computed == sum(r.fair_share.tenants["default"].tokens_computed for r in (first, second))
    assert merged.replicas == [first.replica_view(), second.replica_view()]
    assert merged.dp_rank is None

    one, both = first.to_dict(), merged.to_dict()
    assert set(one) == TOP_LEVEL_KEYS and set(both) == TOP_LEVEL_KEYS - {"dp_rank"} | {"replicas"}
    for view in (one, both):
        assert set(view["cache"]) == CACHE_KEYS and set(view["cache"]["tree"]) == TREE_KEYS
        assert set(view["memory"]) == MEMORY_KEYS
    assert all(set(replica) == REPLICA_KEYS for replica in both["replicas"])
    assert both["num_requests"] == 4 and both["replicas"][1]["queried_tokens"] == second.cache.queried_tokens
    assert msgspec.json.decode(msgspec.json.encode(both)) == both  # plain JSON values only


def report(rank: int, *, matched: int, queried: int, throughput: float, spec: SpecInfo | None = None,
           model_path: str = "m", tenants: dict[str, TenantShare] | None = None, hicache: bool = False,
           disk_capacity: int | None = None, new_token_ratio: float = 0.5) -> ServerInfo:
    """A hand-made one-scheduler report (100 KV slots, 40 used)."""
    tiers = LowerTierMemory(host_total_tokens=300, host_used_tokens=100, host_free_tokens=200, host_bytes_per_token=64,
                            disk_used_tokens=10, disk_capacity_tokens=disk_capacity) if hicache else None
    moves = HiCacheInfo(write_policy="write_through", backed_up_tokens=5, loaded_from_host_tokens=4,
                        written_to_disk_tokens=3, loaded_from_disk_tokens=2, dropped_tokens=1) if hicache else None
    return ServerInfo(
        model=ModelInfo(context_len=256, vocab_size=512, max_total_num_tokens=100, max_running_requests=8,
                        page_size=1, eos_token_ids=[2], model_path=model_path, device="cpu", dtype="float32",
                        attention_backend="torch_native", chunked_prefill_size=None, schedule_policy="fcfs",
                        overlap_schedule=False, radix_cache=True, hierarchical_cache=hicache),
        counters=SchedulerCounters(**{name: rank + 1 for name in SchedulerCounters.__struct_fields__}),
        gen_throughput=throughput,
        memory=MemoryInfo(total_tokens=100, free_tokens=50, evictable_tokens=10, protected_tokens=0,
                          lower_tiers=tiers),
        cache=CacheInfo(matched_tokens=matched, queried_tokens=queried,
                        tree=TreeCounters(queried_tokens=queried, matched_tokens=matched),
                        namespaces={"": NamespaceCounters(queried_tokens=queried, matched_tokens=matched)},
                        hicache=moves),
        num_running_reqs=rank, num_queued_reqs=2 * rank, new_token_ratio=new_token_ratio,
        tensor_parallel=TensorParallelLayout(tp_size=1, num_attention_heads=4, num_key_value_heads=2,
                                             attention_heads_per_rank=4, kv_heads_per_rank=2,
                                             kv_heads_replicated=False, backend=None),
        fair_share=FairShareInfo(enabled=True, tenants=tenants or {}),
        cascade_batches=rank, speculative=spec, dp_rank=rank, num_pending_requests_in_tokenizer_manager=rank)


def test_rates_are_recomputed_from_the_summed_parts():
    busy = report(0, matched=1, queried=1, throughput=30.0, new_token_ratio=0.4,
                  spec=SpecInfo(verify_steps=10, num_proposed_drafts=10, num_accepted_drafts=9, num_verified_entries=10))
    idle = report(1, matched=0, queried=99, throughput=10.0, new_token_ratio=0.6,
                  spec=SpecInfo(verify_steps=90, num_proposed_drafts=90, num_accepted_drafts=0, num_verified_entries=90))
    merged = ServerInfo.merge([busy, idle])
    assert merged.cache.hit_rate == pytest.approx(1 / 100)  # not the mean of 1.0 and 0.0
    assert merged.cache.namespaces[""].hit_rate == pytest.approx(1 / 100)
    assert merged.speculative.accept_rate == pytest.approx(9 / 100)
    assert merged.speculative.avg_accept_length == pytest.approx(1 + 9 / 100)
    assert merged.gen_throughput == 40.0  # each replica's tokens per second: the server's is their sum
    assert merged.new_token_ratio == pytest.approx(0.5)
    assert merged.token_usage == pytest.approx(0.4)
    assert merged.num_pending_requests_in_tokenizer_manager == 1
    assert merged.cascade_batches == 1 and merged.num_queued_reqs == 2
    views = merged.to_dict()["replicas"]
    assert [view["avg_spec_accept_length"] for view in views] == pytest.approx([1.9, 1.0])
    flat = merged.to_dict()
    assert flat["spec_num_accepted_drafts"] == 9 and flat["spec_accept_rate"] == pytest.approx(0.09)
    assert "avg_spec_accept_length" not in report(0, matched=0, queried=0, throughput=0.0).to_dict()


def test_lower_tiers_and_tenants_merge_by_meaning():
    alpha = {"alpha": TenantShare(weight=2.0, tokens_computed=30, live_requests=1)}
    both = {**alpha, "default": TenantShare(weight=1.0, tokens_computed=5, live_requests=0)}
    merged = ServerInfo.merge([report(0, matched=0, queried=0, throughput=0.0, hicache=True, tenants=alpha),
                               report(1, matched=0, queried=0, throughput=0.0, hicache=True, tenants=both)])
    memory = merged.to_dict()["memory"]
    assert memory["host_total_tokens"] == 600 and memory["disk_used_tokens"] == 20
    assert memory["host_bytes_per_token"] == 64  # a size of one token: the same on every replica, not a sum
    assert memory["disk_capacity_tokens"] is None  # unbounded anywhere: unbounded
    assert merged.to_dict()["cache"]["hicache"] == {
        "write_policy": "write_through", "backed_up_tokens": 10, "loaded_from_host_tokens": 8,
        "written_to_disk_tokens": 6, "loaded_from_disk_tokens": 4, "dropped_tokens": 2}
    assert merged.fair_share.tenants == {"alpha": TenantShare(weight=2.0, tokens_computed=60, live_requests=2),
                                         "default": TenantShare(weight=1.0, tokens_computed=5, live_requests=0)}
    bounded = ServerInfo.merge([report(r, matched=0, queried=0, throughput=0.0, hicache=True, disk_capacity=1000)
                                for r in range(2)])
    assert bounded.memory.lower_tiers.disk_capacity_tokens == 2000


def test_a_replica_that_disagrees_is_logged_and_the_first_kept(caplog):
    with caplog.at_level(logging.WARNING, logger="radixserve.runtime.wire.replica_merge"):
        merged = ServerInfo.merge([report(1, matched=0, queried=0, throughput=0.0, model_path="new"),
                                   report(0, matched=0, queried=0, throughput=0.0, model_path="old")])
    assert merged.model.model_path == "old"  # the lowest rank's
    assert "model_path" in caplog.text and "'new'" in caplog.text


def test_one_report_merges_to_itself_plus_its_view():
    one = report(0, matched=3, queried=4, throughput=2.0)
    merged = ServerInfo.merge([one])
    assert merged.replicas == [one.replica_view()]
    assert msgspec.structs.replace(merged, replicas=None, dp_rank=0) == one


def test_the_report_crosses_the_wire_unchanged():
    message = GetServerInfoReqOutput("rpc", report(3, matched=1, queried=2, throughput=1.5, hicache=True,
                                                   spec=SpecInfo(verify_steps=1, num_proposed_drafts=2,
                                                                 num_accepted_drafts=1, num_verified_entries=1)))
    assert decode(encode(message)) == message


def test_metrics_read_the_report():
    metrics = ServerMetrics("m")
    info = report(0, matched=1, queried=4, throughput=12.5,
                  spec=SpecInfo(verify_steps=4, num_proposed_drafts=15, num_accepted_drafts=6, num_verified_entries=4))
    lines = metrics.render(info, 3)[0].decode().splitlines()
    for line in ('radixserve:spec_accept_length{model_name="m"} 2.5', 'radixserve:spec_accept_rate{model_name="m"} 0.4',
                 'radixserve:cache_hit_rate{model_name="m"} 0.25', 'radixserve:token_usage{model_name="m"} 0.4',
                 'radixserve:num_used_tokens{model_name="m"} 40.0', 'radixserve:gen_throughput{model_name="m"} 12.5'):
        assert line in lines
