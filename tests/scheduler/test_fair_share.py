"""Fair share across tenants and priority within a tenant (scheduler/fair_share.py).

The queue itself on plain requests (no model), then a real Scheduler on a tiny model driven in-process: a tenant
that floods the queue with 20x the requests of another does not delay the other's request, and two flooding
tenants weighted 2:1 get tokens computed in that ratio.
"""

from __future__ import annotations

import pytest

from radixserve.runtime.wire.sampling_params import SamplingParams
from radixserve.scheduler.fair_share import FairShare
from radixserve.scheduler.req import Req
from scheduler_driver import SchedulerDriver


def req(rid: str, tenant: str = "", prompt_len: int = 10, priority=None, weight: float = 1.0) -> Req:
    namespace = ("tenant:" + tenant,) if tenant else ()
    return Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=4), namespace,
               priority=priority, tenant_weight=weight)


def arrive(share: FairShare, *reqs: Req) -> list[Req]:
    for r in reqs:
        share.on_arrival(r)
    return list(reqs)


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_equal_tenants_interleave_whatever_their_queue_lengths():
    share = FairShare()
    queue = arrive(share, *[req(f"a{i}", "a") for i in range(6)], req("b0", "b"), req("b1", "b"))
    assert rids(share.order(queue)) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_the_tenant_served_less_goes_first_until_it_catches_up():
    share = FairShare()
    queue = arrive(share, *[req(f"a{i}", "a") for i in range(3)], *[req(f"b{i}", "b") for i in range(4)])
    share.charge(queue[0], 25)  # a has had 25 tokens computed; b none
    # b's requests cost 10 tokens each: b0, b1, b2 take b to 30 > 25, then a0 goes.
    assert rids(share.order(queue)) == ["b0", "b1", "b2", "a0", "b3", "a1", "a2"]


def test_weights_split_the_order_by_tokens():
    share = FairShare()
    queue = arrive(share, *[req(f"a{i}", "a", weight=2.0) for i in range(6)],
                   *[req(f"b{i}", "b") for i in range(6)])
    order = rids(share.order(queue))
    first_six = order[:6]
    assert sum(r.startswith("a") for r in first_six) == 4, order  # two of a's per one of b's


def test_charges_follow_tokens_computed_and_weights():
    share = FairShare()
    a, b = arrive(share, req("a", "a", weight=4.0), req("b", "b"))
    share.charge_batch([(a, 0, 40, None), (b, 0, 10, None)], [a, b])
    assert share.tokens == {"a": 41, "b": 11}
    assert share.service["a"] == pytest.approx(41 / 4) and share.service["b"] == pytest.approx(11)


def test_an_idle_tenant_banks_no_credit():
    share = FairShare()
    a, b = arrive(share, req("a", "a"), req("b", "b"))
    share.charge(a, 1000)
    share.charge(b, 800)
    late = req("c", "c")
    share.on_arrival(late)
    assert share.service["c"] == 800  # the smallest counter of the tenants already waiting or running
    share.on_done(a)
    share.on_done(a)  # idempotent
    assert share.live["a"] == 0 and share.live["b"] == 1


def test_priority_orders_within_a_tenant_never_across_tenants():
    share = FairShare(priority_enabled=True)
    queue = arrive(share, req("a-low", "a", priority=1), req("a-high", "a", priority=9), req("a-none", "a"),
                   req("b-low", "b", priority=-5))
    share.charge(queue[0], 100)  # a is ahead: b's request goes first despite its lower priority
    assert rids(share.order(queue)) == ["b-low", "a-high", "a-low", "a-none"]
    low_first = FairShare(priority_enabled=True, low_values_first=True, default_priority=5)
    queue = arrive(low_first, req("x", priority=3), req("y"), req("z", priority=-1))
    assert rids(low_first.order(queue)) == ["z", "x", "y"]


def test_without_priority_scheduling_the_field_is_ignored_or_refused():
    queue = [req("p1", priority=1), req("p9", priority=9)]
    assert rids(FairShare().order(queue)) == ["p1", "p9"]  # policy order
    assert FairShare().check(queue[1]) is None
    refusing = FairShare(abort_on_priority=True)
    assert "--enable-priority-scheduling" in refusing.check(queue[1])
    assert refusing.check(req("none")) is None


def test_disabled_fair_share_keeps_policy_order():
    share = FairShare(enabled=False)
    queue = arrive(share, *[req(f"a{i}", "a") for i in range(3)], req("b0", "b"))
    share.charge(queue[0], 1000)
    assert rids(share.order(queue)) == ["a0", "a1", "a2", "b0"]


# ---- a real scheduler --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def finish_order(driver: SchedulerDriver, max_steps: int = 5000) -> list[str]:
    """Step to idle; the rids in the order their requests finished."""
    order: list[str] = []
    for _ in range(max_steps):
        if driver.scheduler.is_idle():
            break
        driver.step()
        for rid, result in driver.results.items():
            if result.finish_reason is not None and rid not in order:
                order.append(rid)
    assert driver.scheduler.is_idle()
    return order


@pytest.mark.parametrize("fair", [True, False], ids=["fair-share", "no-fair-share"])
def test_a_flooding_tenant_cannot_starve_another(tiny_llama, fair):
    driver = SchedulerDriver(tiny_llama, max_running_requests=2, disable_fair_share=not fair)
    try:
        for i in range(20):
            driver.submit(f"a{i}", [5 + i, 6, 7, 8, 9, 10, 11, 12], namespace=("tenant:a",), max_new_tokens=8)
        driver.step()  # a's first two requests are running, 18 wait
        driver.submit("b", [40, 41, 42, 43, 44, 45, 46, 47], namespace=("tenant:b",), max_new_tokens=8)
        order = finish_order(driver)
    finally:
        driver.close()
    assert len(order) == 21 and all(r.finish_reason["type"] == "length" for r in driver.results.values())
    position = order.index("b")
    if fair:
        assert position <= 3, order  # b takes the first row a finishing request frees
    else:
        assert position >= 18, order  # first come, first served: b waits behind every queued request of a


def test_two_flooding_tenants_share_tokens_by_weight(tiny_llama):
    driver = SchedulerDriver(tiny_llama, max_running_requests=3)
    try:
        for i in range(24):
            for tenant, weight in (("a", 2.0), ("b", 1.0)):
                driver.submit(f"{tenant}{i}", [3 + i, 4, 5, 6, 7, 8], namespace=(f"tenant:{tenant}",),
                              tenant_weight=weight, max_new_tokens=10)
        share = driver.scheduler.fair_share
        # While both tenants are backlogged (until a quarter of the requests finished), count tokens computed.
        while sum(r.finish_reason is not None for r in driver.results.values()) < 12:
            driver.step()
        ratio = share.tokens["a"] / share.tokens["b"]
        info = driver.server_info()["fair_share"]
        finish_order(driver)
    finally:
        driver.close()
    assert 1.6 <= ratio <= 2.5, (ratio, share.tokens)
    assert info["enabled"] and info["tenants"]["a"]["weight"] == 2.0 and info["tenants"]["b"]["weight"] == 1.0


def test_priority_orders_a_tenants_queue(tiny_llama):
    driver = SchedulerDriver(tiny_llama, max_running_requests=1, enable_priority_scheduling=True)
    try:
        driver.submit("first", [1, 2, 3, 4], max_new_tokens=4)
        driver.step()  # running; the rest wait
        for name, priority in (("low", 0), ("high", 10), ("mid", 5)):
            driver.submit(name, [9, 8, 7, priority + 1], priority=priority, max_new_tokens=4)
        order = finish_order(driver)
    finally:
        driver.close()
    assert order == ["first", "high", "mid", "low"]


def test_a_priority_is_refused_when_the_server_says_so(tiny_llama):
    driver = SchedulerDriver(tiny_llama, abort_on_priority_when_disabled=True)
    try:
        driver.submit("p", [1, 2, 3], priority=3, max_new_tokens=2)
        driver.submit("plain", [1, 2, 3], max_new_tokens=2)
        driver.run_until_idle()
    finally:
        driver.close()
    refused = driver.results["p"].finish_reason
    assert refused["type"] == "abort" and refused["status_code"] == 400 and "priority" in refused["message"]
    assert driver.results["plain"].finish_reason["type"] == "length"


def test_preemption_takes_a_row_from_the_tenant_furthest_above_its_share():
    share = FairShare()
    running = arrive(share, *[req(f"a{i}", "a") for i in range(4)])
    for i, r in enumerate(running):
        r.output_ids = [0] * (10 - i)
    waiting = arrive(share, req("b0", "b"))
    assert share.preemption_victim(waiting, running, max_running=4).rid == "a3"  # fewest outputs
    assert share.preemption_victim(waiting, running, max_running=5) is None  # a row is free
    assert share.preemption_victim(arrive(share, req("a9", "a")), running, 4) is None  # one tenant only
    balanced = running[:2] + arrive(share, req("b1", "b"), req("b2", "b"))
    assert share.preemption_victim(waiting, balanced, 4) is None  # b holds its share already
    # Three tenants over two rows: a newcomer takes a row from the one holding both, never ping-pong after.
    two = running[:2]
    assert share.preemption_victim(arrive(share, req("c0", "c")), two, 2) is not None
    assert share.preemption_victim([req("c1", "c")], [two[0], req("b3", "b")], 2) is None
    assert FairShare(preempt=False).preemption_victim(waiting, running, 4) is None


def test_preempted_requests_finish_with_the_same_output(tiny_llama):
    outputs = {}
    for fair in (True, False):
        driver = SchedulerDriver(tiny_llama, max_running_requests=4, disable_fair_share=not fair)
        try:
            for i in range(6):
                driver.submit(f"a{i}", [5 + i, 6, 7, 8, 9], namespace=("tenant:a",), max_new_tokens=12)
            driver.step()
            driver.step()
            driver.submit("b", [40, 41, 42, 43], namespace=("tenant:b",), max_new_tokens=4)
            order = finish_order(driver)
            retractions = driver.scheduler.stats.num_retractions
        finally:
            driver.close()
        outputs[fair] = {rid: r.output_ids for rid, r in driver.results.items()}
        if fair:
            assert order[0] == "b" and retractions >= 1, (order, retractions)
    assert outputs[True] == outputs[False]


def test_a_tenant_below_its_row_share_goes_first_even_when_served_more():
    share = FairShare()
    running = arrive(share, *[req(f"a{i}", "a") for i in range(3)])
    retracted, light = arrive(share, req("a-back", "a"), req("b0", "b"))
    share.charge(light, 500)  # b has had more tokens computed than a
    assert rids(share.order([retracted, light], running, max_running=4)) == ["b0", "a-back"]
    assert rids(share.order([retracted, light])) == ["a-back", "b0"]  # without rows: counters alone


@pytest.mark.parametrize("fair", [True, False], ids=["fair-share", "no-fair-share"])
def test_a_short_request_does_not_wait_behind_another_tenants_chunked_prompt(tiny_llama, fair):
    long_prompt = [(7 * i) % 500 + 3 for i in range(240)]  # 15 chunks of 16 tokens
    short_prompt = [40, 41, 42, 43, 44, 45]

    def run(with_b: bool) -> tuple[dict, int, int]:
        driver = SchedulerDriver(tiny_llama, chunked_prefill_size=16, disable_fair_share=not fair)
        try:
            driver.submit("a", long_prompt, namespace=("tenant:a",), max_new_tokens=6)
            driver.step()  # a's first chunk
            if with_b:
                driver.submit("b", short_prompt, namespace=("tenant:b",), max_new_tokens=6)
            steps_to_b = steps_to_a = 0
            while not driver.scheduler.is_idle():
                driver.step()
                steps_to_b += with_b and not driver.results["b"].output_ids
                steps_to_a += not driver.results["a"].output_ids
        finally:
            driver.close()
        return {rid: r.output_ids for rid, r in driver.results.items()}, steps_to_b, steps_to_a

    outputs, steps_to_b, steps_to_a = run(with_b=True)
    alone, _, _ = run(with_b=False)
    assert outputs["a"] == alone["a"]  # a's chunks, interleaved with b, compute the same
    assert len(outputs["b"]) == 6 and steps_to_a >= 13
    if fair:
        assert steps_to_b <= 2, steps_to_b  # b's prompt joins the very next batch, ahead of a's next chunk
    else:
        assert steps_to_b >= 13, steps_to_b  # b waits until a's whole prompt is computed
