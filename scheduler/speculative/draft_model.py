"""STANDALONE drafts: a small model of the same vocabulary proposes tokens greedily, with its own KV pool.

The draft model runs in its own ModelRunner (its own weights, `req_to_token` rows and KV slots, page size 1)
with its own radix tree (`DraftModelProposer.tree`, a RadixCache over the draft pool). Each request gets a
draft row when it first drafts, starting from the longest prefix of its tokens the draft tree holds in its
namespace (locked while the request runs); `SpecState.draft_kv_len` says how many of the request's leading
tokens have draft KV. When the request leaves the running batch, its draft KV goes into the draft tree, so a
later request with the same system prompt or chat history prefills only the rest for the draft model. The
draft tree is kept in step with the target's: it only ever receives KV of tokens the target verified (a
request's draft KV is settled after every verify step, below, before it can leave), and it is flushed with it.

One proposal step for requests with `n` tokens (prompt + outputs) and a budget of `k` drafts:
1. catch-up: one extend batch over each request's tokens without draft KV (the whole prompt the first time,
   then the tokens the last verify step added), whose last-token logits give draft 1 (argmax);
2. `k - 1` decode batches, each feeding the previous draft and taking the argmax as the next one.
Afterwards the draft KV covers `n + k - 1` positions; `settle` keeps the positions whose tokens the target
accepted and frees the rest, so the next step's catch-up starts where the two models agree.

Greedy drafts are point masses, which is what the acceptance rule (model_runner/spec_sampling.py) assumes, so
the target's output distribution is unchanged whatever the draft model is.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.radix_cache.tree import RadixCache
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.batch import allocate_slots
from radixserve.scheduler.req import Req


class DraftModelProposer:
    def __init__(self, args: ServerArgs, target_runner) -> None:
        from radixserve.model_runner.model_runner import ModelRunner
        from radixserve.model_runner.runner_config import RunnerConfig

        draft_args = dataclasses.replace(
            args, model_path=args.speculative_draft_model_path, speculative_algorithm=None,
            speculative_draft_model_path=None, speculative_num_draft_tokens=None, speculative_num_steps=None,
            speculative_eagle_topk=None, load_format="auto", page_size=1, context_length=target_runner.context_len,
            max_running_requests=target_runner.max_running_requests,
        )
        self.runner = ModelRunner(RunnerConfig.from_server_args(draft_args))
        if self.runner.vocab_size != target_runner.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.runner.vocab_size} tokens) differs from the "
                             f"target's ({target_runner.vocab_size}): a STANDALONE draft must share the tokenizer")
        self.rows, self.allocator = self.runner.req_to_token_pool, self.runner.allocator
        # Verified tokens' draft KV, reused across requests; evicted (LRU) when the draft pool runs short.
        self.tree = RadixCache(self.rows, self.allocator, page_size=1)
        self.num_reused_tokens = 0  # prompt tokens whose draft KV came from the tree

    # ---- proposing -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        budgets = [min(budget, req.spec.draft_len) for req, budget in zip(reqs, budgets)]  # adaptive length
        active = [i for i, budget in enumerate(budgets) if budget > 0 and self._has_row(reqs[i])]
        if not active:
            return drafts
        tokens = [reqs[i].all_ids for i in active]
        prefix_lens = [reqs[i].spec.draft_kv_len for i in active]
        extend = [len(t) - p for t, p in zip(tokens, prefix_lens)]
        slots = self._allocate([reqs[i] for i in active], prefix_lens, extend)
        if slots is None:
            return drafts
        input_ids = [tok for t, p in zip(tokens, prefix_lens) for tok in t[p:]]
        next_ids = self._forward(ForwardMode.EXTEND, [reqs[i] for i in active], prefix_lens, extend, input_ids, slots)
        for i, token, n in zip(active, next_ids, (len(t) for t in tokens)):
            reqs[i].spec.draft_kv_len = n
            drafts[i].append(token)
        step = 1
        while True:
            active = [i for i in active if budgets[i] > step]
            if not active:
                break
            group = [reqs[i] for i in active]
            kv_lens = [req.spec.draft_kv_len for req in group]
            slots = self._allocate(group, kv_lens, [1] * len(group))
            if slots is None:
                break
            next_ids = self._forward(ForwardMode.DECODE, group, kv_lens, [1] * len(group),
                                     [drafts[i][-1] for i in active], slots)
            for i, req, token in zip(active, group, next_ids):
                req.spec.draft_kv_len += 1
                drafts[i].append(token)
            step += 1
        return drafts

    def _has_row(self, req: Req) -> bool:
        state = req.spec
        if state.draft_row is not None:
            return True
        state.draft_row = self.rows.alloc()
        if state.draft_row is None:
            return False
        # All but the last token at most: the catch-up forward must compute one token to give draft 1.
        match = self.tree.match_prefix(req.all_ids[:-1], req.namespace)
        self.tree.inc_lock_ref(match.last_node)
        self.rows.req_to_token[state.draft_row, : match.length] = match.indices.to(self.rows.req_to_token.dtype)
        state.draft_node, state.draft_prefix_len, state.draft_kv_len = match.last_node, match.length, match.length
        self.num_reused_tokens += match.length
        return True

    def _allocate(self, reqs: list[Req], kv_lens: list[int], extend_lens: list[int]) -> Optional[torch.Tensor]:
        return allocate_slots(self.allocator, self.tree, self.rows, [r.spec.draft_row for r in reqs], kv_lens,
                              extend_lens)

    def _forward(self, mode: ForwardMode, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int],
                 input_ids: list[int], slots: torch.Tensor) -> list[int]:
        device = self.runner.device
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        extend = torch.tensor(extend_lens, dtype=torch.int64)
        starts = torch.cumsum(extend, 0) - extend
        positions = torch.repeat_interleave(prefix, extend) + torch.arange(int(extend.sum())) - \
            torch.repeat_interleave(starts, extend)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        batch = ForwardBatch(
            mode=mode, input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions.to(device), out_cache_loc=slots.to(device, torch.int64),
            req_pool_indices=torch.tensor([r.spec.draft_row for r in reqs], dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device), prefix_lens=prefix.to(device),
            extend_lens=extend.to(device), seq_lens_cpu=seq_lens, prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens), req_to_token_pool=self.rows,
            token_to_kv_pool=self.runner.token_to_kv_pool,
        )
        logits = self.runner.forward(batch)
        return self.runner.sync_sampled(logits.argmax(dim=-1)).tolist()

    # ---- after the verify step -------------------------------------------------------------------
    def settle(self, req: Req, num_before: int, num_taken: int, num_accepted: int) -> None:
        """Keep draft KV for the tokens both models agree on: the tokens before the step and the accepted drafts
        that the draft model fed itself (all but its last draft), never the request's newest token."""
        state = req.spec
        if state.draft_row is None or req.req_pool_idx is None:
            return
        num_drafted = state.draft_kv_len - num_before + 1  # drafts proposed this step (0 if none)
        keep = num_before + max(0, min(num_accepted, num_drafted - 1, num_taken - 1))
        keep = min(keep, state.draft_kv_len, num_before + num_taken - 1)
        self._trim(req, keep)

    def _trim(self, req: Req, keep: int) -> None:
        state = req.spec
        assert keep >= state.draft_prefix_len, "the draft tree's slots are the tree's to free"
        if keep < state.draft_kv_len:
            table = self.rows.req_to_token
            self.allocator.free(table[state.draft_row, keep: state.draft_kv_len].to("cpu", torch.int64))
            state.draft_kv_len = keep

    def release(self, req: Req) -> None:
        """Hand the request's draft KV (verified tokens only: settled after its last step) to the draft tree."""
        state = req.spec
        if state is None or state.draft_row is None:
            return
        length = state.draft_kv_len
        slots = self.rows.req_to_token[state.draft_row, :length].to("cpu", torch.int64)
        present = self.tree.insert(req.all_ids[:length], slots, req.namespace) if length else 0
        assert present >= state.draft_prefix_len, "the draft tree lost a locked prefix"
        self.allocator.free(slots[state.draft_prefix_len: present])  # copies of tokens the tree already had
        self.tree.dec_lock_ref(state.draft_node)
        self.rows.free(state.draft_row)
        state.draft_row, state.draft_node, state.draft_prefix_len, state.draft_kv_len = None, None, 0, 0

    def flush(self) -> None:
        self.tree.reset()

    def check_idle(self) -> None:
        assert self.tree.protected_size() == 0, "idle scheduler holds draft tree locks"
        assert self.allocator.available_size() + self.tree.evictable_size() == self.allocator.size, \
            "idle scheduler leaked draft KV slots"
        assert self.rows.available_size() == self.rows.size, "idle scheduler leaked draft rows"
