"""Where each request of a hybrid model's batch reads and writes its recurrent states (radix_cache/state_pool.py).

A request's working state lives in the slot of its row. For each entry of a batch (`plan_state_slots`):

- an entry starting at position 0 reads a fresh zero state;
- an entry continuing where its working state ends (the next chunk, a decode step) reads its working slot;
- an entry resuming from a cached prefix (just admitted, or re-admitted after a retraction) reads the snapshot the
  tree holds at the end of that prefix (radix_cache/hybrid.py), which its locked prefix keeps alive;
- every entry writes its new state to its working slot, and an extend also to the snapshot slots the tree gave the
  nodes ending after its tokens and before its last token (`Req.pending_snapshot`, `Req.pending_snapshot_before_last`,
  set by `cache_unfinished_req` for this batch).

`Req.state_len` records how far the working state reaches once the batches built so far have run; batches run in
the order they are built, so the plan of the next one can rely on it.
"""

from __future__ import annotations

from radixserve.model_runner.forward_batch import StateSlots
from radixserve.radix_cache.base import PrefixCache
from radixserve.scheduler.batch import ScheduleBatch


def plan_state_slots(batch: ScheduleBatch, cache: PrefixCache) -> StateSlots:
    read, write, snapshot, before_last = [], [], [], []
    for req, prefix_len, extend_len in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        row = req.req_pool_idx
        if prefix_len == 0:
            source = -1
        elif req.state_len == prefix_len:
            source = row
        else:
            source = cache.state_snapshot(req.last_node, prefix_len)
            if source < 0:
                raise AssertionError(f"request {req.rid} resumes at {prefix_len} tokens, where the cache holds no "
                                     f"state snapshot (its state covers {req.state_len})")
        read.append(source)
        write.append(row)
        snapshot.append(req.pending_snapshot)
        before_last.append(req.pending_snapshot_before_last)
        req.pending_snapshot = req.pending_snapshot_before_last = -1
        req.state_len = prefix_len + extend_len
    return StateSlots(read, write, snapshot, before_last)
