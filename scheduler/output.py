"""Turning requests with news into one BatchTokenOut per step.

A streaming request is sent whenever it has new tokens; a non-streaming one only once, when it finishes
(its message then carries every token). A finished request is sent exactly once, with its finish reason,
and never again. Logprob lists are per request only when some request in the message asked for them. What
the detokenizer needs only once per request (its stop strings, the prompt's logprobs) comes with its first
output.
"""

from __future__ import annotations

from typing import Iterable, Optional

from radixserve.runtime.wire.messages import BatchTokenOut, SpecCounts
from radixserve.runtime.wire.weights import DEFAULT_WEIGHT_VERSION
from radixserve.scheduler.req import Req


def has_news(req: Req) -> bool:
    """Whether `req` has something to send: its end, or (streaming) its first tokens or `stream_interval` more."""
    if req.finish_sent:
        return False
    if req.finished:
        return True
    unsent = len(req.output_ids) - req.num_sent_tokens
    return req.stream and unsent > 0 and (unsent >= req.stream_interval or req.num_sent_tokens == 0)


def build_batch_token_out(reqs: Iterable[Req], weight_version: str = DEFAULT_WEIGHT_VERSION) -> Optional[BatchTokenOut]:
    """The message for the requests among `reqs` that have news (computed with weights `weight_version`), marking
    what it sends as sent."""
    ready = [req for req in reqs if has_news(req)]
    if not ready:
        return None
    with_logprobs = any(req.return_logprob for req in ready)
    with_spec = any(req.spec is not None for req in ready)
    with_embeddings = any(req.embedding is not None for req in ready)
    out = BatchTokenOut(
        rids=[], new_token_ids=[], finish_reasons=[], prompt_tokens=[], completion_tokens=[], cached_tokens=[],
        skip_special_tokens=[], spaces_between_special_tokens=[], stop=[], weight_version=weight_version,
    )
    for req in ready:
        start = req.num_sent_tokens
        params = req.sampling_params
        out.rids.append(req.rid)
        out.new_token_ids.append(req.output_ids[start:])
        out.finish_reasons.append(req.finished_reason)
        out.prompt_tokens.append(req.prompt_len)
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.num_cached_tokens or 0)
        out.queue_times.append(req.queue_time)
        out.skip_special_tokens.append(params.skip_special_tokens)
        out.spaces_between_special_tokens.append(params.spaces_between_special_tokens)
        # Stop strings travel once, with the first output; the detokenizer keeps them until the request finishes.
        out.stop.append(list(params.stop) if start == 0 else [])
        if with_logprobs:
            first = start == 0
            out.output_token_logprobs.append(req.output_token_logprobs[start:])
            out.output_top_logprobs.append(req.output_top_logprobs[start:])
            # Prompt-token logprobs (from logprob_start_len on) travel once, with a request's first output.
            send_input = first and req.return_logprob
            out.input_token_logprobs.append(list(req.input_token_logprobs) if send_input else None)
            out.input_top_logprobs.append(list(req.input_top_logprobs) if send_input else None)
        if with_spec:
            spec = req.spec
            out.spec.append(None if spec is None else SpecCounts(spec.verify_ct, spec.num_accepted, spec.num_proposed))
        if with_embeddings:
            out.embeddings.append(req.embedding)
        req.num_sent_tokens = len(req.output_ids)
        if req.finished:
            req.finish_sent = True
    return out
