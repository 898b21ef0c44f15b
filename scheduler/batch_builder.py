"""Turns the planners' choice (extends and decodes whose KV slots are allocated) into a ScheduleBatch ready to
launch: its sampling tensors, prompt-logprob rows, grammar mask and shared-prefix groups, and counts it.

The speculator's verify batches are built by the speculator (scheduler/speculative/speculator.py), not here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.scheduler.batch import ScheduleBatch, assemble_batch
from radixserve.scheduler.fair_share import FairShare
from radixserve.radix_cache.base import PrefixCache
from radixserve.scheduler.grammar import GrammarManager
from radixserve.scheduler.hybrid_state import plan_state_slots
from radixserve.scheduler.input_logprobs import plan_input_logprobs
from radixserve.scheduler.pooling import PoolingBatch
from radixserve.scheduler.prefix_groups import prefix_groups_for
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_reuse import SamplingInfoReuse
from radixserve.scheduler.stats import SchedulerStats
from radixserve.scheduler.stop import StopChecker


class BatchBuilder:
    def __init__(self, *, runner: Any, device: torch.device, stop_checker: StopChecker, grammars: GrammarManager,
                 fair_share: FairShare, stats: SchedulerStats, cache: Optional[PrefixCache] = None) -> None:
        self.runner = runner  # the ModelRunner: its vocabulary and attention backend
        # A hybrid model's batches say where each request's recurrent state is (scheduler/hybrid_state.py).
        self.state_cache = cache if getattr(runner, "state_pool", None) is not None else None
        self.device = device
        self.stop_checker = stop_checker
        self.grammars = grammars
        self.fair_share = fair_share
        self.stats = stats
        self.sampling_reuse = SamplingInfoReuse()  # steady decode batches keep their sampling tensors

    def make(self, mode: ForwardMode, extends: list, decodes: list[Req],
             decode_slots: Optional[torch.Tensor]) -> ScheduleBatch:
        """The batch of `extends` ((request, prefix_len, extend_len, slots)) then `decodes` (slots in
        `decode_slots`); its tokens are charged to their tenants."""
        batch = assemble_batch(mode, extends, decodes, decode_slots, self.stop_checker, self.runner.vocab_size,
                               self.device, self.sampling_reuse)
        batch.input_logprobs = plan_input_logprobs(batch)
        batch.grammar_mask = self.grammars.mask_for(batch)
        batch.prefix_groups = prefix_groups_for(mode, decodes, self.runner.attn_backend)
        batch.pooling = PoolingBatch.of(batch.reqs)
        if self.state_cache is not None:
            batch.state_slots = plan_state_slots(batch, self.state_cache)
        self.fair_share.charge_batch(extends, decodes)
        self.stats.on_batch(batch)
        return batch
