"""What the detokenizer's output does to the TokenizerManager's request states, and what a finished state tells its
caller and the request observer.

`handle_text_out` appends each entry of a BatchTextOut to the ReqState it names (entries of requests whose caller
went away are dropped) and wakes the caller waiting on the state's group; a state that finishes goes to `observe`,
which hands its meta_info and chunk arrival times to the manager's `request_observer`. `raise_if_failed` turns a state
that finished with an error into the exception its caller gets. `manager` is the TokenizerManager; all of it runs on
its event loop thread.
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.runtime.wire.errors import request_failed
from radixserve.runtime.wire.messages import BatchTextOut
from radixserve.tokenizer_manager.state import ReqState

logger = logging.getLogger(__name__)


def handle_text_out(manager: Any, out: BatchTextOut) -> None:
    with_logprobs = len(out.output_token_logprobs) == len(out.rids)
    with_input_logprobs = len(out.input_token_logprobs) == len(out.rids)
    for i, rid in enumerate(out.rids):
        entry = manager.rid_to_state.get(rid)
        if entry is None:
            continue  # its caller went away; the abort is on its way
        state, group = entry
        if state.finished:
            continue
        if with_logprobs and state.return_logprob:
            state.output_token_logprobs.extend(out.output_token_logprobs[i])
            if len(out.output_top_logprobs) == len(out.rids):
                state.output_top_logprobs.extend(out.output_top_logprobs[i])
        if with_input_logprobs and out.input_token_logprobs[i] is not None:
            state.input_token_logprobs = out.input_token_logprobs[i]
            if len(out.input_top_logprobs) == len(out.rids):
                state.input_top_logprobs = out.input_top_logprobs[i]
        state.append(out.text_deltas[i], out.new_token_ids[i], out.finish_reasons[i],
                     out.prompt_tokens[i], out.completion_tokens[i], out.cached_tokens[i],
                     out.queue_times[i] if out.queue_times else None)
        if out.spec:
            state.spec = out.spec[i]
        if out.embeddings:
            state.embedding = out.embeddings[i]
        state.weight_version = out.weight_version
        group.notify(state.index)
        if state.finished:
            observe(manager, state)


def observe(manager: Any, state: ReqState) -> None:
    if manager.request_observer is None:
        return
    try:
        # The observer also learns the request's tenant (meta_info itself never carries it).
        meta = {**state.meta_info(lambda token_id: None), "tenant": state.tenant}
        manager.request_observer(meta, list(state.token_times))
    except Exception:
        logger.exception("request_observer failed")


def raise_if_failed(state: ReqState) -> None:
    """A request that finished with an error (not a plain abort) raises its typed exception to the caller."""
    if state.error_status is not None:
        raise request_failed(state.finish_reason.get("message") or "the request failed", state.error_status)
