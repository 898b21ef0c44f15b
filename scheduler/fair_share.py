"""Who is admitted next when several tenants wait: a weighted fair queue over tokens computed, and per-request
priority within a tenant.

Fair share (on unless `--disable-fair-share`): every tenant has a service counter, the tokens computed for it
(prefill tokens and decoded tokens alike) divided by its weight (`weight` in the tenants file, default 1). The
waiting queue is served tenant by tenant, the tenant with the smallest counter first, so over any busy period
the tokens computed per tenant approach the ratio of their weights, whatever the number of requests each one
sends: a tenant that floods the queue moves its own requests back, not the others'. This is the virtual token
counter of Sheng et al. ("Fairness in Serving Large Language Models", OSDI 2024). Two rules keep it honest:
- a tenant that had nothing queued or running joins at the smallest counter among the tenants that do (never
  below it), so idle time is not banked as credit to flood with later;
- within one admission round, each request taken raises its tenant's counter by its expected prefill, so one
  round interleaves tenants instead of handing the whole batch to the tenant that was behind.
When every request row is taken (`--max-running-requests`), order alone would make a newcomer wait for a flooding
tenant's requests to finish; so a tenant below its weighted share of the rows takes one from the tenant furthest
above its share, whose request goes back to the queue with its KV cached (`preemption_victim`; off with
`--disable-fair-share-preemption`). Likewise a tenant's long prompt, prefilled chunk by chunk, does not hold the
chunk budget of every batch until it is done: another tenant's short request that the fair order puts first joins
the next batch ahead of the next chunk (`ahead_of_chunk`).

Priority (SGLang's `priority` field, honoured with `--enable-priority-scheduling`): within one tenant, larger
values go first (`--schedule-low-priority-values-first`: smaller ones); a request without one has
`--default-priority-value` (0 when unset). Without priority scheduling the field is ignored, as SGLang does,
unless `--abort-on-priority-when-disabled` makes such a request fail (400).

`--schedule-policy` orders requests within a tenant and priority class: `order` receives the queue already in
policy order and keeps it for ties. Tenants are the first part of the cache namespace ("tenant:<id>"); requests
without one (no tenants file) form one tenant, the default.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterable, Optional, Sequence

from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.req import Req


class FairShare:
    """Service counters per tenant and the admission order they imply.

    The scheduler calls `on_arrival(req)` once per request it queues, `on_done(req)` once when a request leaves
    (finished or aborted), `charge_batch(...)` for the tokens each batch computes, `preemption_victim(...)` and
    `order(candidates, running, max_running)` before each admission round, and `ahead_of_chunk(...)` when a
    long prompt is being prefilled in chunks.
    """

    def __init__(self, enabled: bool = True, priority_enabled: bool = False, low_values_first: bool = False,
                 default_priority: Optional[int] = None, abort_on_priority: bool = False, preempt: bool = True,
                 ) -> None:
        self.enabled = enabled
        self.preempt = preempt
        self.abort_on_priority = abort_on_priority
        self.priority_enabled = priority_enabled
        self.low_values_first = low_values_first
        self.default_priority = 0 if default_priority is None else default_priority
        self.service: dict[str, float] = {}  # tenant -> tokens computed / weight
        self.tokens: Counter[str] = Counter()  # tenant -> tokens computed (unweighted), for statistics
        self.weights: dict[str, float] = {}  # tenant -> weight of its latest request
        self.live: Counter[str] = Counter()  # tenant -> requests queued or running
        self._live_rids: set[str] = set()

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> "FairShare":
        return cls(not args.disable_fair_share, args.enable_priority_scheduling,
                   args.schedule_low_priority_values_first, args.default_priority_value,
                   args.abort_on_priority_when_disabled, not args.disable_fair_share_preemption)

    # ---- bookkeeping --------------------------------------------------------------------------------
    def check(self, req: Req) -> Optional[str]:
        """Why `req` cannot be served under these rules (a 400 message), or None."""
        if req.priority is not None and not self.priority_enabled and self.abort_on_priority:
            return ("priority: this server does not schedule by priority (start it with "
                    "--enable-priority-scheduling), and it refuses requests that set one")
        return None

    def on_arrival(self, req: Req) -> None:
        tenant = req.tenant
        self.weights[tenant] = req.tenant_weight
        self._live_rids.add(req.rid)
        if self.live[tenant] == 0:
            active = [self.service.get(t, 0.0) for t, n in self.live.items() if n > 0 and t != tenant]
            floor = min(active) if active else self.service.get(tenant, 0.0)
            self.service[tenant] = max(self.service.get(tenant, 0.0), floor)
        self.live[tenant] += 1

    def on_done(self, req: Req) -> None:
        """`req` left the scheduler (idempotent)."""
        if req.rid not in self._live_rids:
            return
        self._live_rids.discard(req.rid)
        tenant = req.tenant
        self.live[tenant] -= 1
        if self.live[tenant] <= 0:
            del self.live[tenant]

    def charge(self, req: Req, num_tokens: int) -> None:
        """Record `num_tokens` computed for `req` (its extend length, or 1 for a decoded token)."""
        self.tokens[req.tenant] += num_tokens
        self.service[req.tenant] = self.service.get(req.tenant, 0.0) + num_tokens / self._weight(req.tenant)

    def charge_batch(self, extends: list, decodes: list[Req]) -> None:
        """Charge a batch: `extends` are the scheduler's (req, prefix_len, extend_len, slots) entries."""
        for req, _, extend_len, _ in extends:
            self.charge(req, extend_len)
        for req in decodes:
            self.charge(req, 1)

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def effective_priority(self, req: Req) -> int:
        return self.default_priority if req.priority is None else req.priority

    # ---- the decision -----------------------------------------------------------------------------
    def order(self, candidates: Iterable[Req], running: Sequence[Req] = (), max_running: int = 0) -> list[Req]:
        """`candidates` (the waiting queue in policy order) in the order admission should try them.

        A tenant holding fewer of the `max_running` request rows than its weighted share goes first (the rows a
        preemption frees go to the tenant it was made for); then the smallest counter."""
        candidates = list(candidates)
        if self.priority_enabled:
            sign = 1 if self.low_values_first else -1
            candidates.sort(key=lambda r: sign * self.effective_priority(r))  # stable: policy order for ties
        if not self.enabled:
            return candidates
        per_tenant: dict[str, list[Req]] = {}
        for req in candidates:
            per_tenant.setdefault(req.tenant, []).append(req)
        if len(per_tenant) == 1:
            return candidates
        held = Counter(r.tenant for r in running)
        share = self._row_share(set(per_tenant), held, max_running)

        def key(tenant: str, counter: float) -> tuple:
            below = max_running > 0 and held[tenant] < share(tenant)
            return (not below, counter, first_seen[tenant], tenant)

        first_seen = {tenant: i for i, tenant in reversed(list(enumerate(r.tenant for r in candidates)))}
        heap = [key(t, self.service.get(t, 0.0)) for t in per_tenant]
        heapq.heapify(heap)
        cursor = dict.fromkeys(per_tenant, 0)
        ordered: list[Req] = []
        while heap:
            _, counter, _, tenant = heapq.heappop(heap)
            queue = per_tenant[tenant]
            req = queue[cursor[tenant]]
            ordered.append(req)
            cursor[tenant] += 1
            held[tenant] += 1
            if cursor[tenant] < len(queue):
                cost = max(1, req.fill_len() - req.kv_len) / self._weight(tenant)
                heapq.heappush(heap, key(tenant, counter + cost))
        return ordered

    def ahead_of_chunk(self, chunked: Optional[Req], ordered: list[Req], running: Sequence[Req] = (),
                       max_running: int = 0, chunk_budget: float = 0) -> list[Req]:
        """The waiting requests (of `ordered`, the admission order) that go into the next batch before the next
        chunk of `chunked`, the request whose long prompt is being prefilled chunk by chunk.

        Without this a chunked prompt takes the whole chunk budget of every batch until it is done, so another
        tenant's short request waits behind all of its chunks. A request goes first when its tenant is not the
        chunked request's, it comes before the chunked request in the fair order, and its whole prompt fits in
        the chunk budget (so it is never chunked itself: one chunked request at a time)."""
        if chunked is None or not self.enabled:
            return []
        fair = self.order([chunked, *ordered], running, max_running)
        ahead: list[Req] = []
        budget = chunk_budget
        for req in fair[: fair.index(chunked)]:
            if req.tenant != chunked.tenant and req.fill_len() <= budget:
                ahead.append(req)
                budget -= req.fill_len()
        return ahead

    def _row_share(self, waiting_tenants: set[str], held: Counter, max_running: int):
        """Each backlogged tenant's weighted share of the `max_running` request rows, as a function of the tenant."""
        backlogged = waiting_tenants | set(held)
        total_weight = sum(self._weight(t) for t in backlogged) or 1.0
        return lambda tenant: max_running * self._weight(tenant) / total_weight

    def preemption_victim(self, waiting: list[Req], running: list[Req], max_running: int) -> Optional[Req]:
        """A running request to send back to the queue so that a tenant below its share of the request rows gets
        one now, or None. Only when every row is taken, a waiting tenant holds less than its weighted share of the
        rows, and another tenant would still hold at least its share without one; the victim is that tenant's
        request with the fewest outputs (the least work to redo; its KV stays cached for its return). `order`
        then puts the tenant below its share first, so the freed row goes to it."""
        if not (self.enabled and self.preempt) or not waiting or len(running) < max_running:
            return None
        held = Counter(r.tenant for r in running)
        waiting_tenants = {r.tenant for r in waiting}
        if len(waiting_tenants | set(held)) < 2:
            return None
        share = self._row_share(waiting_tenants, held, max_running)
        if not any(held[t] < share(t) for t in waiting_tenants):
            return None
        # Still at or above its share after giving one up: preemption never swings back and forth.
        over = [t for t in held if held[t] - 1 >= share(t)]
        if not over:
            return None
        tenant = max(over, key=lambda t: held[t] - share(t))
        return min((r for r in running if r.tenant == tenant), key=lambda r: (len(r.output_ids), -r.arrival_seq))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per tenant: weight, tokens computed and requests queued or running (for server info)."""
        tenants = set(self.tokens) | set(self.live)
        return {tenant or "default": {"weight": self._weight(tenant), "tokens_computed": self.tokens[tenant],
                                      "live_requests": self.live[tenant]} for tenant in sorted(tenants)}
