"""The result processor: takes each launched batch's sampled tokens into its requests, in launch order.

- A plain batch: each entry that samples an output appends its token (with logprobs), and its request finishes
  if it stops there (scheduler/stop.py, the grammar). Under overlap a request that finished in the batch before
  may sit in this one too: its extra token is dropped, and it is released once this batch is processed.
- A verify batch (speculative decoding): each request takes its accepted drafts and one sampled token, up to
  where it stops; the speculator frees the rejected drafts' KV (`settle`) before the request may finish.
- A batch the device could not hold even after the executor's retry fails alone (`fail_batch`).

`inflight` holds the launched batches whose results are not processed yet, oldest first; `resolve_inflight`
waits for all of them (the planners call it when they must see those results first).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import Any, Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.radix_cache.base import PrefixCache
from radixserve.radix_cache.pool import KVAllocator
from radixserve.runtime.wire.messages import FinishReason
from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.grammar import GrammarManager
from radixserve.scheduler.input_logprobs import collect_input_logprobs
from radixserve.scheduler.lifecycle import RequestLifecycle
from radixserve.scheduler.output import has_news
from radixserve.scheduler.overlap import LaunchedBatch
from radixserve.scheduler.pooling import finish_vector, take_share
from radixserve.scheduler.req import Req
from radixserve.scheduler.stats import SchedulerStats, decode_log_line, used_kv_tokens
from radixserve.scheduler.stop import StopChecker
from radixserve.scheduler.window_release import WindowRelease

logger = logging.getLogger(__name__)

OUT_OF_MEMORY_MESSAGE = ("the server ran out of device memory while running this request's batch; retry later, or "
                         "lower --mem-fraction-static / --chunked-prefill-size / --cuda-graph-max-bs on the server")


class ResultProcessor:
    def __init__(self, *, requests: RequestLifecycle, cache: PrefixCache, allocator: KVAllocator,
                 grammars: GrammarManager, stop_checker: StopChecker, speculator: Any, stats: SchedulerStats,
                 device: torch.device, decode_log_interval: int, pooling_method: Optional[str],
                 window_release: Optional[WindowRelease] = None) -> None:
        self.requests = requests
        self.cache = cache
        self.allocator = allocator
        self.grammars = grammars
        self.stop_checker = stop_checker
        self.speculator = speculator  # a Speculator, or NoSpeculation (scheduler/speculative/)
        self.stats = stats
        self.device = device  # the runner's
        self.decode_log_interval = decode_log_interval
        self.pooling_method = pooling_method  # how the runner pools embeddings (scheduler/pooling.py)
        # Sliding-window models with window slots: frees what left each request's window once its batch has run.
        self.window_release = window_release
        self.inflight: deque[LaunchedBatch] = deque()

    def process(self, launched: LaunchedBatch) -> None:
        """Wait for the results of `launched` (the oldest batch in flight, already taken off `inflight`)."""
        batch = launched.batch
        try:
            result = launched.result()
        except torch.OutOfMemoryError as error:
            self.fail_batch(batch, error)
            return
        if batch.verify is not None:
            self._process_verify(batch, result)
            return
        collect_input_logprobs(batch, result)
        for i, req in enumerate(batch.reqs):
            req.num_inflight -= 1
            if req.finished:
                self.requests.maybe_release(req)
                continue
            if result.pooled is not None and i in result.pooled:
                take_share(req, result.pooled[i], batch.prefix_lens[i], self.pooling_method)
            if not batch.samples_output[i]:
                continue  # an unfinished chunk: its sample is not an output
            try:
                self._process_output(req, result, i)
            except Exception as error:  # one request's failure must not take the batch or the server down
                logger.exception("processing the output of request %s failed", req.rid)
                self.requests.finish(req, FinishReason.abort(
                    f"internal error while processing this request's output ({type(error).__name__})", 500))
        if self.window_release is not None:
            self.window_release.after_batch(batch)
        # The grammar masks of the batch in flight may have waited for exactly these tokens.
        self.grammars.fill_pending()
        if batch.mode == ForwardMode.DECODE:
            self.stats.decode_steps += 1
            interval = self.decode_log_interval
            if interval > 0 and self.stats.decode_steps % interval == 0:
                self._log_decode()

    def resolve_inflight(self) -> None:
        """Process every batch in flight (a forced sync under overlap)."""
        self.stats.forced_syncs += bool(self.inflight)
        while self.inflight:
            self.process(self.inflight.popleft())

    def fail_batch(self, batch: ScheduleBatch, error: BaseException) -> None:
        """The device ran out of memory for `batch` even after the executor's retry: its requests finish with an
        error (503, so clients may retry) and the server goes on.

        The batch's tokens were already in the radix tree (every extend batch inserts at scheduling), and batches
        launched after it may have read their never-written KV. So the results of those later batches are
        dropped, every other request holding KV is retracted (it recomputes and completes with the same
        output), and the tree is emptied: no slot of unwritten KV can be matched again."""
        logger.error("out of device memory running a batch of %d requests (%d new tokens); they fail: %s",
                     len(batch.reqs), batch.num_new_tokens, str(error).splitlines()[0] if str(error) else error)
        self.stats.num_failed_batches += 1
        for req in batch.reqs:
            req.num_inflight -= 1
        while self.inflight:
            later = self.inflight.popleft()
            with contextlib.suppress(torch.OutOfMemoryError):
                later.result()
            for req in later.batch.reqs:
                req.num_inflight -= 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        requests = self.requests
        for req in requests.reqs.values():
            req.kv_unwritten = req.req_pool_idx is not None  # nothing goes into the tree: it is emptied below
        for req in batch.reqs:
            if not req.finished:
                requests.finish(req, FinishReason.abort(OUT_OF_MEMORY_MESSAGE, status_code=503))
        if requests.chunked_req is not None and not requests.chunked_req.finished:
            requests.running.append(requests.chunked_req)  # retracted below with the running ones
        requests.chunked_req = None
        if requests.running:
            logger.warning("%d running requests are retracted and recompute after the failed batch",
                           len(requests.running))
        for req in list(requests.running):
            requests.retract(req)
        for req in list(requests.reqs.values()):
            requests.maybe_release(req)
        requests.retention.release_all()
        self.cache.reset()
        self.speculator.flush()

    def _process_output(self, req: Req, result: Any, i: int) -> None:
        """Take entry i's sampled token into `req` and finish it if it stops here."""
        if req.max_new_tokens == 0:
            if req.pooling is not None:
                req.embedding = finish_vector(req, self.pooling_method)
            self.requests.finish(req, FinishReason.max_length(0))
            return
        if result.no_token is not None and result.no_token[i]:
            req.ended_without_sample = True
            self.requests.finish(req, FinishReason.abort(
                f"no token satisfies the request's constraints at output position {len(req.output_ids)} (its "
                "grammar, min_new_tokens and banned tokens together allow none)", status_code=400))
            return
        logprob = result.logprobs[i] if result.logprobs is not None else None
        top = result.top_logprobs[i] if result.top_logprobs is not None else None
        reason = self._take_token(req, result.next_token_ids[i], logprob, top)
        if reason is not None:
            self.requests.finish(req, reason)
        elif has_news(req):
            self.requests.news[req.rid] = req

    def _take_token(self, req: Req, token: int, logprob: Optional[float],
                    top: Optional[list]) -> Optional[FinishReason]:
        """Append one output token; the reason the request stops there, if it does."""
        req.append_token(token, logprob, top)
        self.stats.on_tokens(1)
        grammar_reason = self.grammars.accept(req, token)
        return self.stop_checker.check(req) or grammar_reason

    def _process_verify(self, batch: ScheduleBatch, result: Any) -> None:
        """A verify batch: each request takes its accepted drafts and one sampled token, up to where it stops;
        its KV is settled (scheduler/speculative/speculator.py) before it may finish."""
        for i, (req, chain) in enumerate(zip(batch.reqs, result.chains)):
            req.num_inflight -= 1
            taken, reason = 0, None
            for taken, token in enumerate([] if req.finished else chain.tokens, 1):
                logprob = result.logprobs[i][taken - 1] if result.logprobs is not None else None
                top = result.top_logprobs[i][taken - 1] if result.top_logprobs is not None else None
                if (reason := self._take_token(req, token, logprob, top)) is not None:
                    break
            self.speculator.settle(req, batch.prefix_lens[i], taken, batch.extend_lens[i] - 1, chain.num_accepted)
            if reason is None and chain.no_token and not req.finished:
                reason = FinishReason.abort(f"no token satisfies the request's constraints at output position "
                                            f"{len(req.output_ids)}", status_code=400)
            if reason is not None:
                self.requests.finish(req, reason)
            elif req.finished:
                self.requests.maybe_release(req)
            elif has_news(req):
                self.requests.news[req.rid] = req

    def _log_decode(self) -> None:
        requests = self.requests
        logger.info(decode_log_line(len(requests.running), len(requests.waiting),
                                    used_kv_tokens(self.allocator, self.cache), self.allocator.size,
                                    self.stats.cache_hit_rate, self.stats.close_window()))
