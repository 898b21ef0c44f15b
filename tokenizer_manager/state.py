"""Per-request state in the TokenizerManager, and the result dicts built from it.

A caller's normalized request becomes a `ReqGroup` of `ReqState`s (one per prompt and per sample of `n`). The
receive loop appends each BatchTextOut entry to its ReqState and marks it dirty in its group; the caller's
coroutine waits on the group's event, then takes streaming chunks (the whole output so far, or with incremental
streaming what is new since the last chunk) or, once every state finished, the final results. All of it lives on the TokenizerManager's event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from radixserve.runtime.wire.messages import FinishReason, SpecCounts
from radixserve.runtime.wire.request import NormalizedRequest
from radixserve.runtime.wire.weights import DEFAULT_WEIGHT_VERSION

TokenText = Callable[[int], Optional[str]]  # token id -> its text, or None when texts were not asked for


def spec_meta_info(spec: SpecCounts, completion_tokens: int) -> dict[str, Any]:
    """SGLang's speculative meta_info keys: verify steps, accepted / proposed drafts, their ratio, and the
    accept length (output tokens per verify step)."""
    return {
        "spec_verify_ct": spec.verify_ct,
        "spec_accept_token_num": spec.accepted_drafts,
        "spec_draft_token_num": spec.proposed_drafts,
        "spec_accept_rate": spec.accepted_drafts / spec.proposed_drafts if spec.proposed_drafts else 0.0,
        "spec_accept_length": completion_tokens / spec.verify_ct if spec.verify_ct else 0.0,
    }


@dataclass
class ReqState:
    rid: str  # the id inside the engine (see manager.engine_rid)
    display_rid: str  # the id the caller knows: its rid, with "-<i>" per sample when n > 1
    user_rid: str  # the caller's rid, before the n expansion added "-<i>"
    tenant: Optional[str]
    index: int  # position in the caller's (n-expanded) batch, and in its ReqGroup's states
    prompt_ids: tuple[int, ...]
    return_logprob: bool
    logprob_start_len: int
    created: float = field(default_factory=time.monotonic)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[dict[str, Any]] = None  # FinishReason.to_dict(), SGLang's meta_info shape
    error_status: Optional[int] = None  # set when the request finished with an error (its HTTP status)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: Optional[float] = None  # seconds the scheduler held it before its first admission
    spec: Optional[SpecCounts] = None  # speculative decoding counts, when it runs
    weight_version: str = DEFAULT_WEIGHT_VERSION  # the weights of its latest tokens (runtime/wire/weights.py)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_logprobs: Optional[list[Optional[float]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[int, float]]]]] = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each chunk of new tokens
    finished_at: Optional[float] = None
    embedding: Optional[list[float]] = None  # a pooling request's vector (runtime/wire/pooling.py)
    # How much of text / output_ids the streaming consumer has already taken.
    text_taken: int = 0
    ids_taken: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, text: str, ids: list[int], finish_reason: Optional[FinishReason], prompt_tokens: int,
               completion_tokens: int, cached_tokens: int, queue_time: Optional[float] = None) -> None:
        now = time.monotonic()
        if queue_time is not None:
            self.queue_time = queue_time
        self.text += text
        self.output_ids.extend(ids)
        if ids:
            self.token_times.append(now)
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt_tokens, completion_tokens, cached_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason.to_dict()
            self.error_status = finish_reason.status_code
            self.finished_at = now

    def meta_info(self, token_text: TokenText, logprobs_from: int = 0) -> dict[str, Any]:
        """meta_info with the output logprobs of tokens [logprobs_from:] (all of them by default)."""
        meta: dict[str, Any] = {
            "id": self.display_rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
        }
        if self.queue_time is not None:
            meta["queue_time"] = self.queue_time
        if self.spec is not None:
            meta.update(spec_meta_info(self.spec, self.completion_tokens))
        if self.finished_at is not None:
            meta["e2e_latency"] = self.finished_at - self.created
            if self.token_times:
                meta["ttft"] = self.token_times[0] - self.created
        if self.return_logprob:
            ids = self.output_ids[logprobs_from:]
            meta["output_token_logprobs"] = [
                (lp, tid, token_text(tid)) for lp, tid in zip(self.output_token_logprobs[logprobs_from:], ids)
            ]
            meta["output_top_logprobs"] = [
                [(lp, tid, token_text(tid)) for tid, lp in top] for top in self.output_top_logprobs[logprobs_from:]
            ]
            # SGLang's: the output logprobs so far, whichever part of them this chunk carries (a client of an
            # incremental stream places the chunk's entries at length - len(entries)).
            meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
            if logprobs_from == 0:
                meta["input_token_logprobs"] = self._input_logprobs(token_text)
                meta["input_top_logprobs"] = self._input_top_logprobs(token_text)
        return meta

    def _input_logprobs(self, token_text: TokenText) -> list[tuple[Optional[float], int, Optional[str]]]:
        if not self.input_token_logprobs:
            return []
        start = max(self.logprob_start_len, 0)
        ids = self.prompt_ids[start : start + len(self.input_token_logprobs)]
        return [(lp, tid, token_text(tid)) for lp, tid in zip(self.input_token_logprobs, ids)]

    def _input_top_logprobs(self, token_text: TokenText) -> list[Optional[list[tuple[float, int, Optional[str]]]]]:
        """Per prompt position from logprob_start_len: its top alternatives (None at position 0); [] when
        top_logprobs_num was 0."""
        return [None if top is None else [(lp, tid, token_text(tid)) for tid, lp in top]
                for top in self.input_top_logprobs or []]

    def result(self, token_text: TokenText) -> dict[str, Any]:
        if self.embedding is not None:  # SGLang's shape for an embedding
            return {"embedding": self.embedding, "meta_info": self.meta_info(token_text)}
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info(token_text)}

    def take_chunk(self, token_text: TokenText, incremental: bool) -> dict[str, Any]:
        """One streaming chunk. `incremental`: only what is new since the previous chunk (text, output_ids and
        their output logprobs); otherwise the whole text, output_ids and logprobs so far (SGLang's default).
        meta_info's counters are always the totals so far."""
        ids_from = self.ids_taken if incremental else 0
        chunk = {
            "text": self.text[self.text_taken :] if incremental else self.text,
            "output_ids": self.output_ids[ids_from:],
            "meta_info": self.meta_info(token_text, logprobs_from=ids_from),
            "index": self.index,
        }
        self.text_taken, self.ids_taken = len(self.text), len(self.output_ids)
        return chunk


class ReqGroup:
    """The states of one caller's request, the request itself, the event its coroutine waits on, and any engine
    failure."""

    def __init__(self, states: list[ReqState], request: NormalizedRequest):
        self.states = states
        self.request = request
        self.event = asyncio.Event()
        self.dirty: dict[int, None] = {}  # indices (into states) with news, in arrival order
        self.error: Optional[BaseException] = None

    def notify(self, position: int) -> None:
        self.dirty[position] = None
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    @property
    def all_finished(self) -> bool:
        return all(state.finished for state in self.states)

    async def wait(self) -> list[ReqState]:
        """Wait for news; return the states that have some (raises the group's error, if any)."""
        while not self.dirty and self.error is None:
            self.event.clear()
            await self.event.wait()
        if self.error is not None:
            # A fresh instance per raise: one failure may reach many callers, each with its own traceback.
            raise type(self.error)(*self.error.args)
        news = [self.states[position] for position in self.dirty]
        self.dirty.clear()
        return news
