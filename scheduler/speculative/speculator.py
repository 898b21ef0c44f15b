"""The speculative decoder's scheduling side: build verify batches, and settle each request's KV afterwards.

Called from one place each in the Scheduler: `plan` from its decode step (a verify batch, or None for a plain
decode step), `settle` once per entry when a verify batch's result is processed.

KV ownership through a verify step of a request whose KV covers `K` positions (its last output, at position
`K`, has none yet):
- `plan` allocates slots for positions `K .. K + k` (the last output and `k` drafts), records them in the
  request's row and raises `kv_len` to `K + k + 1`; the tree is not touched, so it never holds a draft;
- `settle`, once the request has taken `n` tokens (accepted drafts, then the sampled one; fewer when it
  stopped), lowers `kv_len` to `K + n` and frees the slots past it: rejected drafts, and accepted ones after a
  stop. Only then may the request be finished (which hands `all_ids[:kv_len]` to the tree).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.sampling_info import SamplingBatchInfo, seeded_uniform
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.speculative_args import resolved_num_draft_tokens
from radixserve.scheduler.batch import ScheduleBatch, allocate_slots
from radixserve.scheduler.req import Req
from radixserve.scheduler.speculative.draft_model import DraftModelProposer
from radixserve.scheduler.speculative.proposers import NgramProposer, Proposer
from radixserve.scheduler.speculative.state import SpecState
from radixserve.scheduler.speculative.verify import VerifyPlan
from radixserve.scheduler.stop import StopChecker


class Speculator:
    def __init__(self, args: ServerArgs, runner, cache, stop_checker: StopChecker) -> None:
        self.max_drafts = resolved_num_draft_tokens(args) - 1
        if args.speculative_algorithm == "STANDALONE":
            self.proposer: Proposer = DraftModelProposer(args, runner)
        else:
            self.proposer = NgramProposer(args.speculative_ngram_min_match_window_size,
                                          args.speculative_ngram_max_match_window_size, cache)
        self.runner, self.cache, self.stop_checker = runner, cache, stop_checker
        self.allocator, self.req_to_token_pool = runner.allocator, runner.req_to_token_pool
        self.device = torch.device(runner.device)
        # Totals over the scheduler's life, for server info and metrics.
        self.verify_steps = 0
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verified_entries = 0

    # ---- planning --------------------------------------------------------------------------------
    def plan(self, reqs: list[Req]) -> Optional[ScheduleBatch]:
        """A verify batch for the decoding requests `reqs` (a request without drafts verifies a chain of one),
        or None when a plain decode step should run instead: a request has a grammar (its mask is per step, not
        per chain), or the chains' KV does not fit (the plain step then evicts or retracts as usual)."""
        if any(req.grammar is not None for req in reqs):
            return None
        # The step emits up to drafts + 1 tokens; never more than the request may still produce. Within that the
        # proposer sizes each chain (by the match it continues, or the request's acceptance rate).
        budgets = [min(req.spec.max_drafts, req.max_new_tokens - len(req.output_ids) - 1) for req in reqs]
        drafts = self.proposer.propose(reqs, budgets)
        kv_lens = [req.kv_len for req in reqs]
        slots = allocate_slots(self.allocator, self.cache, self.req_to_token_pool, [r.req_pool_idx for r in reqs],
                               kv_lens, [1 + len(d) for d in drafts])
        if slots is None:
            for req in reqs:  # nothing verified: the proposer keeps only what preceded the step
                self.proposer.settle(req, len(req.all_ids), 0, 0)
            return None
        input_ids, row_drafts, chain_lens = [], [], []
        for req, chain in zip(reqs, drafts):
            req.kv_len += 1 + len(chain)
            input_ids += [req.output_ids[-1]] + chain
            row_drafts += chain + [-1]
            chain_lens.append(1 + len(chain))
        verify = self._verify_plan(reqs, drafts, chain_lens, row_drafts)
        self.verify_steps += 1
        return ScheduleBatch(
            mode=ForwardMode.EXTEND, reqs=list(reqs), rows=[r.req_pool_idx for r in reqs], prefix_lens=kv_lens,
            extend_lens=chain_lens, input_ids=input_ids, table_entries=[], out_cache_loc=slots,
            samples_output=[True] * len(reqs), sampling_info=verify.sampling_info,
            return_logprob=verify.logprob_rows, top_logprobs_num=verify.top_logprobs_num, verify=verify,
        )

    def new_state(self) -> SpecState:
        return SpecState(self.max_drafts)

    def _verify_plan(self, reqs: list[Req], drafts: list[list[int]], chain_lens: list[int],
                     row_drafts: list[int]) -> VerifyPlan:
        params, histories, banned, prompts, draw_u = [], [], [], [], []
        need_prompts = any(req.sampling_params.repetition_penalty != 1.0 for req in reqs)
        for req, chain in zip(reqs, drafts):
            seed = req.sampling_params.seed
            for j in range(len(chain) + 1):
                history = req.output_ids + chain[:j]  # the outputs before the token row j emits
                step = len(history)
                params.append(req.sampling_params)
                histories.append(history)
                prompts.append(req.origin_input_ids)
                banned.append(self.stop_checker.banned_token_ids(req, step))
                draw_u.append(math.nan if seed is None else seeded_uniform(seed, step))
        info = SamplingBatchInfo.build(
            params, histories, self.runner.vocab_size, self.device,
            prompt_ids=prompts if need_prompts else None, banned_token_ids=banned if any(banned) else None,
        )
        return VerifyPlan(
            chain_lens=chain_lens, drafts=row_drafts, sampling_info=info,
            draw_uniforms=torch.tensor(draw_u, dtype=torch.float32),
            logprob_rows=any(r.return_logprob for r in reqs),
            top_logprobs_num=max((r.top_logprobs_num for r in reqs), default=0),
        )

    # ---- after the step --------------------------------------------------------------------------
    def settle(self, req: Req, prefix_len: int, num_taken: int, num_drafts: int, num_accepted: int) -> None:
        """Entry of a verify step whose request (KV before the step: `prefix_len` positions) took `num_taken`
        tokens: keep KV for `prefix_len + num_taken` positions, free the rest, count the acceptance."""
        self._trim_kv(req, prefix_len + num_taken)
        self.proposer.settle(req, prefix_len + 1, num_taken, num_accepted)
        req.spec.on_verified(num_drafts, num_accepted)
        self.num_verified_entries += 1
        self.num_proposed += num_drafts
        self.num_accepted += num_accepted

    def _trim_kv(self, req: Req, new_kv_len: int) -> None:
        old_kv_len = req.kv_len
        if req.req_pool_idx is None or new_kv_len >= old_kv_len:
            return
        assert new_kv_len >= len(req.prefix_indices), "a verify step may only drop the request's own KV"
        table = self.req_to_token_pool.req_to_token
        slots = table[req.req_pool_idx, new_kv_len:old_kv_len].to("cpu", torch.int64)
        page_size = self.allocator.page_size
        if page_size > 1:
            # Whole pages only; the page holding the last kept position stays (the next step fills its tail).
            pages = torch.unique(slots // page_size)
            if new_kv_len > 0:
                pages = pages[pages != int(table[req.req_pool_idx, new_kv_len - 1]) // page_size]
            slots = pages * page_size
        self.allocator.free(slots)
        req.kv_len = new_kv_len

    def release(self, req: Req) -> None:
        """The request left the running batch (finished, aborted, retracted)."""
        self.proposer.release(req)

    def check_idle(self) -> None:
        self.proposer.check_idle()

    def flush(self) -> None:
        """The scheduler flushed its cache: the draft model's tree goes too (they are kept in step)."""
        self.proposer.flush()

    # ---- reporting -------------------------------------------------------------------------------
    def info(self) -> dict:
        """Totals for server info (`internal_states`) and the metrics."""
        rate = self.num_accepted / self.num_proposed if self.num_proposed else 0.0
        length = 1 + self.num_accepted / self.num_verified_entries if self.num_verified_entries else 0.0
        return {"spec_verify_steps": self.verify_steps, "spec_num_proposed_drafts": self.num_proposed,
                "spec_num_accepted_drafts": self.num_accepted, "spec_accept_rate": rate,
                "avg_spec_accept_length": length}
