"""The sampling tensors of a decode batch, kept while the same requests decode with nothing that changes per step.

`build_sampling_info` (scheduler/batch.py) turns every request's parameters into device tensors, one Python
pass over the batch per step: at a batch of 1000 that is milliseconds of host time a step, spent again each step
although a running request's temperature, top-p, top-k and min-p never change. What can change from one step
to the next is the per-step part: a seeded draw's step index, the output history that penalties read, and the
EOS / stop ids banned below `min_new_tokens`. A batch none of whose requests has any of those, and whose requests
are the very ones (same objects, same order) of the batch before, gets that batch's tensors again; any other
batch is built afresh. The tensors are never written after they are built (sampling reads them).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from radixserve.model_runner.sampling_info import SamplingBatchInfo
from radixserve.scheduler.req import Req


def has_per_step_sampling(req: Req) -> bool:
    """Whether `req`'s sampling tensors for its next output depend on the step: a seed, a penalty, or banned ids
    while it is below `min_new_tokens`."""
    p = req.sampling_params
    return p.seed is not None or p.has_penalties() or req.kv_len - req.prompt_len < p.min_new_tokens


class SamplingInfoReuse:
    """Hands out the last decode batch's SamplingBatchInfo again while it still applies (module docstring)."""

    def __init__(self) -> None:
        self._reqs: tuple[Req, ...] = ()  # holds the requests, so none of them is another's look-alike by id
        self._info: Optional[SamplingBatchInfo] = None
        self.num_reused = 0

    def get(self, reqs: Sequence[Req], samples_output: Sequence[bool],
            build: Callable[[], SamplingBatchInfo]) -> SamplingBatchInfo:
        if not all(samples_output) or any(has_per_step_sampling(req) for req in reqs):
            self._reqs, self._info = (), None
            return build()
        if self._info is not None and len(reqs) == len(self._reqs) and all(
                a is b for a, b in zip(reqs, self._reqs)):
            self.num_reused += 1
            return self._info
        self._reqs, self._info = tuple(reqs), build()
        return self._info
