"""Which prompt positions each extend pass computes logprobs for, and gathering them into the request.

A request with `return_logprob` and `logprob_start_len = s >= 0` gets `input_token_logprobs` for its prompt
tokens at positions s, s+1, ..., prompt_len-1: entry j is logprob(token[s+j] | tokens before it), and None
for position 0 (nothing precedes it). The logprob of token p comes from the logits at position p - 1, so:

- Cache: the prefix served from the radix cache is not recomputed, hence it is cut to at most s - 1 tokens
  (`prefix_limit`): position s - 1 and everything after it are computed in this request's own extend pass.
  A request asking for input logprobs from s therefore reuses at most s - 1 cached tokens (none for s <= 1);
  `cached_tokens` reports what it really reused.
- Chunked prefill: each chunk [a, b) yields the positions q in [max(a, s - 1), min(b, prompt_len - 1)), i.e.
  the tokens q + 1; consecutive chunks continue where the previous one stopped, so the list is appended in
  order.
- Once the pass that samples the first output has been processed, the list is complete
  (`input_logprobs_done`); a retracted request that prefills again does not recompute it and may reuse the
  whole cached prefix.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.logprobs import InputLogprobPlan


def wants_input_logprobs(req: Any) -> bool:
    """Whether `req` still needs prompt-token logprobs computed."""
    return req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs_done


def prefix_limit(req: Any, limit: int) -> int:
    """How many leading tokens of `req` may be taken from the cache: `limit`, cut to `logprob_start_len - 1`
    while its prompt-token logprobs are still to be computed."""
    if not wants_input_logprobs(req):
        return limit
    return min(limit, max(req.logprob_start_len - 1, 0))


def plan_input_logprobs(batch: Any) -> Optional[InputLogprobPlan]:
    """The extra logits rows of a ScheduleBatch whose extend entries need prompt-token logprobs, or None."""
    if batch.mode == ForwardMode.DECODE:
        return None
    indices: list[int] = []
    targets: list[int] = []
    counts: list[int] = []
    top_k = 0
    token_start = 0
    for req, prefix_len, extend_len in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        count = 0
        if wants_input_logprobs(req):
            first = max(prefix_len, req.logprob_start_len - 1)
            end = min(prefix_len + extend_len, req.prompt_len - 1)
            if end > first:
                count = end - first
                indices.extend(range(token_start + first - prefix_len, token_start + end - prefix_len))
                targets.extend(req.origin_input_ids[first + 1:end + 1])
                top_k = max(top_k, req.top_logprobs_num)
        counts.append(count)
        token_start += extend_len
    if not indices:
        return None
    return InputLogprobPlan(
        token_indices=torch.tensor(indices, dtype=torch.int64),
        target_ids=torch.tensor(targets, dtype=torch.int64),
        counts=counts,
        top_k=top_k,
    )


def collect_input_logprobs(batch: Any, result: Any) -> None:
    """Append what a processed batch computed to its requests' prompt-token logprobs, in position order."""
    plan = getattr(batch, "input_logprobs", None)
    computed = getattr(result, "input_logprobs", None)
    for i, req in enumerate(batch.reqs):
        if not wants_input_logprobs(req):
            continue
        if batch.prefix_lens[i] == 0 and req.logprob_start_len == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append(None)  # position 0: nothing precedes it
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(None)
        if plan is not None and computed is not None and plan.counts[i]:
            req.input_token_logprobs.extend(computed.logprobs[i])
            if req.top_logprobs_num > 0 and computed.top_logprobs is not None:
                req.input_top_logprobs.extend(top[: req.top_logprobs_num] for top in computed.top_logprobs[i])
        if batch.samples_output[i]:
            req.input_logprobs_done = True
