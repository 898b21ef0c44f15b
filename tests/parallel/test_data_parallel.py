"""`--dp-size 2` end to end on the CPU: two scheduler replicas of the embedded model behind the data-parallel
controller, on the generated-shared-prefix workload (8 groups x 8 prompts; each group's first prompt first,
then the rest at once). Cache-aware routing keeps each group on the replica that cached its prefix (>= 90% of
one replica's hit rate), round robin does measurably worse, greedy outputs equal one replica's, and each
replica's memory accounting holds afterwards."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine


NUM_GROUPS, PER_GROUP = 8, 8
GREEDY = {"max_new_tokens": 4, "temperature": 0}
WORDS = ("river stone light garden paper window silver market engine orbit signal forest harbor lantern "
         "meadow copper violet thunder canyon pillar").split()


def workload() -> tuple[list[str], list[str]]:
    """(the first prompt of each group, the other prompts), each group sharing a ~150-token system prompt."""
    rng = random.Random(7)
    heads, rest = [], []
    for group in range(NUM_GROUPS):
        system = f"Group {group} rules: " + " ".join(rng.choice(WORDS) for _ in range(120))
        prompts = [f"{system}\nQuestion {i}: what is {rng.choice(WORDS)} {rng.choice(WORDS)}?" for i in range(PER_GROUP)]
        heads.append(prompts[0])
        rest.extend(prompts[1:])
    return heads, rest


def run(then=None, **engine_args) -> tuple[list[str], dict]:
    heads, rest = workload()
    with Engine(log_level="warning", **engine_args) as engine:
        texts = [out["text"] for out in engine.generate(heads, GREEDY)]
        texts += [out["text"] for out in engine.generate(rest, GREEDY)]
        info = engine.get_server_info()
        if then is not None:
            then(engine, info)
        return texts, info


def check_routed_rank(engine, info) -> None:
    """SGLang's data_parallel_rank pins a request to a replica (what sglang-router --dp-aware sends)."""
    queried = [replica["queried_tokens"] for replica in info["replicas"]]
    engine.generate(["Pinned to replica one: " + word for word in WORDS[:4]], GREEDY, data_parallel_rank=1)
    after = [replica["queried_tokens"] for replica in engine.get_server_info()["replicas"]]
    assert after[0] == queried[0] and after[1] > queried[1]
    with pytest.raises(ValueError, match="data_parallel_rank"):
        engine.generate("x", GREEDY, data_parallel_rank=2)


@pytest.fixture(scope="module")
def single():
    return run()


def test_cache_aware_routing_keeps_the_hit_rate_of_one_replica(single):
    single_texts, single_info = single
    texts, info = run(check_routed_rank, dp_size=2, load_balance_method="cache_aware")
    assert texts == single_texts
    assert info["dp_size"] == 2 and len(info["replicas"]) == 2
    assert all(replica["queried_tokens"] > 0 for replica in info["replicas"])  # both replicas served
    single_rate, rate = single_info["cache"]["hit_rate"], info["cache"]["hit_rate"]
    assert rate >= 0.9 * single_rate, (rate, single_rate)
    for replica in info["replicas"]:  # idle: every slot is free or held by the cache
        memory = replica["memory"]
        assert memory["free_tokens"] + memory["evictable_tokens"] == memory["total_tokens"]
        assert memory["protected_tokens"] == 0
    test_cache_aware_routing_keeps_the_hit_rate_of_one_replica.rate = rate


@pytest.mark.slow
def test_round_robin_loses_hits(single):
    single_texts, single_info = single
    texts, info = run(dp_size=2, load_balance_method="round_robin")
    assert texts == single_texts
    assert info["cache"]["hit_rate"] < 0.9 * single_info["cache"]["hit_rate"], info["cache"]["hit_rate"]
