"""The scheduler's prefix groups (scheduler/prefix_groups.py): which running requests hold the same KV slots for a
cached prefix, read from the radix tree, checked against the slots themselves in `req_to_token`.

Runs the real scheduler and model on the CPU: requests on two system prompts, one of them also under another
tenant's namespace (same tokens, KV of its own), two identical prompts, and a request that shares nothing.
"""

from __future__ import annotations

import pytest

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.scheduler.prefix_groups import find_prefix_groups, prefix_groups_for
from scheduler_driver import SchedulerDriver

SYSTEM_A = [100 + i for i in range(96)]
SYSTEM_B = [300 + i for i in range(72)]
MIN_LEN = 64


def _prompts():
    return {
        "a0": SYSTEM_A + [11, 12, 13], "a1": SYSTEM_A + [21, 22], "a2": SYSTEM_A + [31, 32, 33, 34],
        "b0": SYSTEM_B + [41, 42], "b1": SYSTEM_B + [51],
        "same0": [7] * 70 + [8, 9], "same1": [7] * 70 + [8, 9],
        "alone": [900 + i for i in range(80)],
        "other-tenant": SYSTEM_A + [61, 62],
    }


@pytest.mark.parametrize("page_size", [1, 8])
def test_groups_name_requests_that_hold_the_same_slots(default_model_dir, page_size):
    driver = SchedulerDriver(default_model_dir, page_size=page_size)
    rids = list(_prompts())
    for rid, prompt in _prompts().items():
        namespace = ("tenant:other",) if rid == "other-tenant" else ()
        driver.submit(rid, prompt, namespace=namespace, max_new_tokens=12)
    scheduler = driver.scheduler
    for _ in range(40):
        driver.step()
        if not scheduler.waiting and scheduler.chunked_req is None and len(scheduler.running) == len(rids):
            break
    running = list(scheduler.running)
    assert len(running) == len(rids), "every request should be decoding"

    groups = find_prefix_groups(running, MIN_LEN)
    assert groups is not None
    named = sorted(sorted(running[i].rid for i in members) for members in groups.members)
    assert named == [["a0", "a1", "a2"], ["b0", "b1"], ["same0", "same1"]]
    by_rid = {tuple(sorted(running[i].rid for i in members)): length
              for members, length in zip(groups.members, groups.lengths)}
    # Shared: the system prompt's whole pages; identical prompts share every whole page of the prompt.
    assert by_rid[("a0", "a1", "a2")] == len(SYSTEM_A) - len(SYSTEM_A) % page_size
    assert by_rid[("b0", "b1")] == len(SYSTEM_B) - len(SYSTEM_B) % page_size
    assert by_rid[("same0", "same1")] == 72 - 72 % page_size
    table = driver.runner.req_to_token_pool.req_to_token
    for members, length in zip(groups.members, groups.lengths):
        rows = [running[i].req_pool_idx for i in members]
        first = table[rows[0], :length]
        assert all(bool((table[row, :length] == first).all()) for row in rows[1:]), "members hold other slots"
    # The other tenant's request has the same tokens as group A's but slots of its own.
    other = next(r for r in running if r.rid == "other-tenant")
    a0 = next(r for r in running if r.rid == "a0")
    assert not bool((table[other.req_pool_idx, :64] == table[a0.req_pool_idx, :64]).any())
    assert groups.saved_positions() == sum((len(m) - 1) * n for m, n in zip(groups.members, groups.lengths))

    # Groups are made only for decode batches of backends that read them.
    class Reads:
        uses_prefix_groups, min_shared_prefix = True, MIN_LEN

    assert prefix_groups_for(ForwardMode.DECODE, running, Reads()) is not None
    assert prefix_groups_for(ForwardMode.MIXED, running, Reads()) is None
    assert prefix_groups_for(ForwardMode.DECODE, running, driver.runner.attn_backend) is None
    assert find_prefix_groups(running, 200) is None  # nothing shares that much

    driver.run_until_idle()
    driver.close()
