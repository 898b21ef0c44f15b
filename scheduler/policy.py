"""Which waiting requests go first (`SchedulePolicy`) and how many fit in one prefill batch (`PrefillAdder`).

Policies (`--schedule-policy`):
- `fcfs`: arrival order (retracted requests first, since they were admitted earlier);
- `lpm`: longest cached prefix first, so requests that share a prefix run while it is cached;
- `dfs-weight`: walk the radix tree depth-first, heaviest subtree (most waiting requests) first, so requests
  under the same prefix run back to back;
- `lof`: longest output (max_new_tokens) first;
- `random`: a seeded shuffle.
The prefix-aware policies fall back to fcfs when the cache does not share (`--disable-radix-cache`); when the
queue is so long that matching every request against the tree would cost more than it saves, they order it by
leading tokens instead (`_by_leading_tokens`): requests that begin alike run back to back, and only each group's
first request is matched against the tree. Groups whose prompt is cached go first (longest cached prefix first, as
lpm does for single requests), then the others in order of their first place in the queue. That is what a burst of
requests on a few shared system prompts needs: the first of a group computes the prompt, the rest follow as soon
as it is in the tree, and while requests still arrive, the cheap ones (their prompt cached) are not held behind the
first requests of groups that arrived before them.

Admission budgets (`PrefillAdder`), in the manner of SGLang's PrefillAdder:
- memory: free + evictable KV tokens, less what running requests are still expected to need
  (`remaining max_new_tokens x new_token_ratio`), less what this batch has already planned;
- `max_prefill_tokens` new tokens per batch (the first request may exceed it, else it could never run);
- `chunked_prefill_size`: a request longer than what is left of the chunk budget is cut into a chunk and
  finishes its prefill in later batches; at most one chunked request at a time;
- `max_running_requests` and free `req_to_token` rows (the scheduler checks those).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any, Callable, Optional

from radixserve.radix_cache.base import PrefixCache
from radixserve.scheduler.req import Req

# Expected outputs are clipped at this many tokens per request when reserving memory, so one request with a
# huge max_new_tokens does not block admission on its own (SGLang uses the same idea).
CLIP_MAX_NEW_TOKENS = 4096
# Expected share of max_new_tokens a request will really generate, for the admission reserve: starts at
# INIT (times schedule_conservativeness), decays with every decode step down to INIT * MIN_FACTOR, and jumps
# back to the start after a retraction (admission was too optimistic) or when the scheduler goes idle.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# Matching every waiting request costs O(total prompt length); beyond this queue length lpm/dfs-weight
# order by leading tokens.
PREFIX_POLICY_MAX_QUEUE = 128
LEADING_TOKENS = 64  # what names a request's group in that ordering (a system prompt differs within it)


class SchedulePolicy:
    """Orders the waiting queue before each admission round."""

    def __init__(self, name: str, cache: PrefixCache, shares_prefixes: bool, seed: int = 0) -> None:
        self.name = name
        self.cache = cache
        self.shares_prefixes = shares_prefixes
        self._rng = random.Random(seed)

    def order(self, waiting: list[Req]) -> list[Req]:
        """Return the waiting requests in the order admission should try them (the list is not modified)."""
        prefix_aware = self.name in ("lpm", "dfs-weight")
        if prefix_aware and not self.shares_prefixes:
            return list(waiting)
        if prefix_aware and len(waiting) > PREFIX_POLICY_MAX_QUEUE:
            return self._by_leading_tokens(waiting)
        if self.name == "fcfs":
            return list(waiting)
        if self.name == "lof":
            return sorted(waiting, key=lambda r: -r.max_new_tokens)
        if self.name == "random":
            shuffled = list(waiting)
            self._rng.shuffle(shuffled)
            return shuffled
        if self.name == "lpm":
            lengths = {id(r): self._match(r).length for r in waiting}
            return sorted(waiting, key=lambda r: -lengths[id(r)])
        if self.name == "dfs-weight":
            return self._dfs_weight(waiting)
        raise ValueError(f"unknown schedule policy {self.name!r}")

    def _match(self, req: Req):
        key = req.all_ids
        return self.cache.match_prefix(key[: len(key) - 1], req.namespace)

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        """Depth-first over the tree nodes where the requests' cached prefixes end, heaviest child first."""
        root = self.cache.tree_root()
        if root is None:
            return list(waiting)
        reqs_at: dict[Any, list[Req]] = defaultdict(list)
        for req in waiting:
            reqs_at[self._match(req).last_node].append(req)
        weight: dict[Any, int] = defaultdict(int)
        for node, reqs in reqs_at.items():
            while node is not None:
                weight[node] += len(reqs)
                node = node.parent
        ordered: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            ordered.extend(reqs_at.get(node, ()))
            children = [c for c in node.children.values() if weight.get(c, 0) > 0]
            # The stack pops the last pushed first: push the lightest first so the heaviest runs next.
            children.sort(key=lambda c: weight[c])
            stack.extend(children)
        return ordered

    def _by_leading_tokens(self, waiting: list[Req]) -> list[Req]:
        """Requests grouped by namespace and first `LEADING_TOKENS` prompt tokens, members in queue order. The
        first `PREFIX_POLICY_MAX_QUEUE` groups (by first place) are ranked by their first member's cached prefix,
        longest first; ties and the groups beyond keep the order of their first place. Matching one request per
        group bounds the tree work at `PREFIX_POLICY_MAX_QUEUE` matches however long the queue is."""
        first_place: dict[tuple, int] = {}
        places = [first_place.setdefault((req.namespace, tuple(req.origin_input_ids[:LEADING_TOKENS])), place)
                  for place, req in enumerate(waiting)]
        rank: dict[int, tuple[int, int]] = {}  # first place -> (-cached prefix length, first place)
        for place in sorted(first_place.values()):
            cached = self._match(waiting[place]).length if len(rank) < PREFIX_POLICY_MAX_QUEUE else 0
            rank[place] = (-cached, place)
        return [waiting[i] for i in sorted(range(len(waiting)), key=lambda i: rank[places[i]])]


class NewTokenRatio:
    """The admission reserve's estimate of how much of its max_new_tokens a running request will still use."""

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.initial = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.minimum = self.initial * MIN_NEW_TOKEN_RATIO_FACTOR
        self.step_decay = (self.initial - self.minimum) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.initial

    def decay(self) -> None:
        self.value = max(self.value - self.step_decay, self.minimum)

    def reset(self) -> None:
        self.value = self.initial


class PrefillAdder:
    """Budgets of one prefill batch; the scheduler asks `plan(...)` for each candidate in policy order.

    `memory_left()` must return free + evictable KV tokens right now (it changes as the scheduler locks
    prefixes and allocates); the adder subtracts the running requests' reserve and its own plans.
    """

    def __init__(
        self,
        memory_left: Callable[[], int],
        running_reserve: float,
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunk_size: Optional[int],
        page_size: int,
    ) -> None:
        self.memory_left = memory_left
        self.running_reserve = running_reserve
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunk_size if chunk_size is not None else math.inf
        self.page_size = page_size
        self.reserved = 0.0  # expected outputs of the requests planned so far
        self.num_planned = 0
        self.stopped = False  # no further request may join this batch
        self.chunked = False  # the batch holds a request cut into a chunk

    def output_reserve(self, req: Req) -> float:
        """Tokens to keep for a request's future outputs, once its prefill is complete."""
        return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def plan(self, req: Req, prefix_len: int, fill_len: int) -> int:
        """Tokens of `req` to compute in this batch (its KV covers `prefix_len` of `fill_len` tokens), or 0
        when it does not fit; a result below `fill_len - prefix_len` means the request is chunked.

        The scheduler must call `commit(req, n)` after it has really admitted the planned tokens.
        """
        if self.stopped:
            return 0
        extend_len = fill_len - prefix_len
        budget = self.memory_left() - self.running_reserve - self.reserved
        # A request may need one page more than its tokens (a partly filled first page).
        slack = self.page_size - 1
        if extend_len <= self.rem_chunk_tokens:
            if self.num_planned and extend_len > self.rem_input_tokens:
                self.stopped = True
                return 0
            if extend_len + slack + self.output_reserve(req) > budget:
                self.stopped = True
                return 0
            return extend_len
        # Cut a chunk that ends on a page boundary, so the tree can take all of it.
        chunk = self.rem_chunk_tokens
        if self.num_planned:
            chunk = min(chunk, self.rem_input_tokens)
        aligned_end = (prefix_len + chunk) // self.page_size * self.page_size
        if aligned_end > prefix_len:
            chunk = aligned_end - prefix_len
        chunk = int(chunk)
        if chunk <= 0 or chunk + slack > budget:
            self.stopped = True
            return 0
        return chunk

    def commit(self, req: Req, planned_len: int, fill_len: int, prefix_len: int) -> None:
        """Record that `planned_len` tokens of `req` joined the batch."""
        self.num_planned += 1
        self.rem_input_tokens -= planned_len
        self.rem_chunk_tokens -= planned_len
        if prefix_len + planned_len < fill_len:
            self.chunked = True
            self.stopped = True  # one chunked request per batch, and it uses the rest of the chunk budget
        else:
            self.reserved += self.output_reserve(req)
        if self.rem_input_tokens <= 0 or self.rem_chunk_tokens <= 0:
            self.stopped = True
