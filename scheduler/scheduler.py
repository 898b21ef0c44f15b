"""The Scheduler: request queues, continuous batching, and the step loop.

One step:  pick the next batch (prefill first, else decode) -> launch it -> process the previous results.

    waiting --admit (policy order, PrefillAdder budgets)--> [chunked] --> running --finish--> released
       ^                                                                     |
       +---------------------------- retract (decode out of memory) ---------+

- Prefill priority: when waiting requests fit, the step runs an extend batch (a long prompt is cut into
  chunks over several steps); otherwise it decodes the running requests. With `enable_mixed_chunk` the
  running requests ride along in the extend batch as one-token entries (ForwardMode.MIXED).
- Overlap (default): batch N+1 is built and launched before batch N's results are processed; decode inputs
  come from the executor's device-side token table, so building never waits for the device. A request that
  finishes in batch N may already sit in batch N+1: its extra token is dropped, and its row and KV are
  released once batch N+1 is processed too (`Req.num_inflight`). The scheduler waits for the batch in
  flight only when it must see its results first: before retracting, and before sampling a request whose
  penalties read its previous token.
- Sharing: the tokens an extend batch computes go into the tree (`cache_unfinished_req`) as soon as the batch
  is built, before it runs: every batch that can read them runs after it. If a request's tokens were already
  in the tree (put there by another request of the same batch), its row is pointed at the tree's copy, which
  that batch writes in the same layer before attending (the AttentionBackend contract: write, then attend).
  A request whose prefix another request of the batch is computing waits one batch rather than compute it too.
- Speculative decoding (scheduler/speculative/, docs/speculative.md): the decode step becomes a verify step
  (`_schedule_verify`) that checks each request's draft chain in one extend forward; `_process_verify` takes the
  accepted tokens and the speculator frees the rejected drafts' KV before a request may finish. Under overlap a
  request's verify step waits for its previous one (`needs_exact_history`); other batches (prefills) overlap it.
- Release: a finished, aborted or retracted request hands its KV to the cache (`cache_finished_req`, so a
  retracted request's re-prefill reuses it) and frees its row, in `_release_kv` and nowhere else.

Messages in (`handle_message`) and outputs out (`take_outputs`) are plain objects, so tests drive a Scheduler
in-process; `process.py` wires it to ZMQ.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import deque
from typing import Any, Optional

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.sampling import PLACEHOLDER_TOKEN_ID
from radixserve.radix_cache.keys import common_prefix_length
from radixserve.runtime.wire.cache_tree import CacheTreeReq, CacheTreeReqOutput
from radixserve.runtime.wire.messages import (
    AbortReq, FinishReason, FlushCacheReq, FlushCacheReqOutput, GetServerInfoReq, GetServerInfoReqOutput, ModelInfo,
    TokenizedGenerateReq,
)
from radixserve.runtime.wire.lora import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.scheduler.batch import ScheduleBatch, allocate_slots, assemble_batch, needs_exact_history
from radixserve.scheduler.cache_view import RecentRequests, cache_tree_summary
from radixserve.scheduler.fair_share import FairShare
from radixserve.scheduler.grammar import GrammarManager
from radixserve.scheduler.prefix_groups import prefix_groups_for
from radixserve.scheduler.sampling_reuse import SamplingInfoReuse
from radixserve.scheduler.info import ready_info, server_info
from radixserve.scheduler.lora import LoRAScheduling
from radixserve.scheduler.input_logprobs import collect_input_logprobs, plan_input_logprobs, prefix_limit
from radixserve.scheduler.output import build_batch_token_out, has_news
from radixserve.scheduler.overlap import BatchExecutor, LaunchedBatch
from radixserve.scheduler.policy import CLIP_MAX_NEW_TOKENS, NewTokenRatio, PrefillAdder, SchedulePolicy
from radixserve.scheduler.req import Req
from radixserve.scheduler.setup import check_request, make_cache, try_load_tokenizer
from radixserve.scheduler.speculative import make_speculator
from radixserve.scheduler.stats import SchedulerStats, decode_log_line, prefill_log_line
from radixserve.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)

# A request whose prefix is computed by a request already in the batch by at least this many more tokens than
# the tree holds waits for the next batch, which finds that prefix in the tree instead of computing it twice.
IN_BATCH_PREFIX_MIN_GAIN = 32


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_runner: Any = None, tokenizer: Any = None) -> None:
        if model_runner is None:
            from radixserve.model_runner.model_runner import ModelRunner
            from radixserve.model_runner.runner_config import RunnerConfig

            model_runner = ModelRunner(RunnerConfig.from_server_args(server_args))
        self.args = server_args
        self.runner = model_runner
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.allocator
        self.page_size = self.allocator.page_size
        self.max_running = model_runner.max_running_requests
        self.cache = make_cache(server_args, self.req_to_token_pool, self.allocator, model_runner.token_to_kv_pool)
        self.tokenizer = tokenizer if tokenizer is not None else try_load_tokenizer(server_args, model_runner.model_dir)
        self.stop_checker = StopChecker(model_runner.model_config.eos_token_ids, self.tokenizer)
        self.sampling_reuse = SamplingInfoReuse()  # steady decode batches keep their sampling tensors
        self.grammars = GrammarManager(self.tokenizer, model_runner.vocab_size, self.stop_checker.eos_token_ids)
        self.policy = SchedulePolicy(
            server_args.schedule_policy, self.cache, not server_args.disable_radix_cache, server_args.random_seed
        )
        self.fair_share = FairShare.from_server_args(server_args)
        self.lora = LoRAScheduling(getattr(model_runner, "lora_manager", None))
        self.overlap = server_args.resolved_overlap_schedule()
        self.executor = BatchExecutor(model_runner, self.overlap)
        self.speculator = make_speculator(server_args, model_runner, self.cache, self.stop_checker)
        self.chunk_size = server_args.resolved_chunked_prefill_size()

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.reqs: dict[str, Req] = {}  # every request not yet released, by rid
        self.inflight: deque[LaunchedBatch] = deque()
        self.stats = SchedulerStats()
        self.recent_requests = RecentRequests()  # paths of finished requests, for the cache page
        self._outputs: list[Any] = []
        self._news: dict[str, Req] = {}  # requests to consider for the next BatchTokenOut
        self._arrivals = itertools.count()
        self._checked_since_work = True
        self.new_token_ratio = NewTokenRatio(server_args.schedule_conservativeness)

    # ---- the loop ----------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling step; returns whether there was any work."""
        batch = self.get_next_batch()
        if batch is not None:
            self._checked_since_work = False
            for req in batch.reqs:
                req.num_inflight += 1
            self.inflight.append(self.executor.launch(batch))
        # With overlap, the batch just launched keeps running while the previous one is processed.
        keep = 1 if self.overlap and batch is not None else 0
        worked = bool(self.inflight)
        while len(self.inflight) > keep:
            self._process_result(self.inflight.popleft())
        if self.is_idle():
            self._on_idle()
        return worked

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked_req or self.inflight or self.grammars.num_queued)

    def get_next_batch(self) -> Optional[ScheduleBatch]:
        self._admit_grammar_ready()
        return self._schedule_prefill() or self._schedule_decode()

    def take_outputs(self) -> list[Any]:
        """Messages for the detokenizer produced since the last call, in order."""
        self._flush_news()
        outputs, self._outputs = self._outputs, []
        return outputs

    # ---- messages ----------------------------------------------------------------------------------
    def handle_message(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            success, message = self.flush_cache()
            self._reply(FlushCacheReqOutput(msg.rpc_id, success, message))
        elif isinstance(msg, GetServerInfoReq):
            self._reply(GetServerInfoReqOutput(msg.rpc_id, self.server_info()))
        elif isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
            self._reply(self.lora.handle(msg, self.reqs, self.cache))
        elif isinstance(msg, CacheTreeReq):
            summary = cache_tree_summary(msg, self.cache, self.allocator, self.reqs, self.recent_requests)
            self._reply(CacheTreeReqOutput(msg.rpc_id, summary))
        else:
            logger.warning("scheduler ignores a message of type %s", type(msg).__name__)

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        if msg.rid in self.reqs:
            logger.error("request id %r is already in use; the new request is dropped", msg.rid)
            return
        req = Req.from_message(msg, next(self._arrivals))
        req.stream_interval = self.args.stream_interval
        req.spec = self.speculator.new_state()
        self.reqs[req.rid] = req
        self.fair_share.on_arrival(req)
        error = check_request(req, self.runner, self.tokenizer) or self.fair_share.check(req) or self.lora.check(req)
        if error is not None:
            self._finish(req, FinishReason.abort(error, status_code=400))
            return
        if self.grammars.submit(req):  # else it waits for its grammar (see _admit_grammar_ready)
            self.waiting.append(req)

    def _admit_grammar_ready(self) -> None:
        """Queue the requests whose grammar finished compiling; fail those whose grammar is invalid."""
        ready, failed = self.grammars.poll()
        for req in ready:
            if req.grammar.allows_a_token(self.runner.vocab_size, self.stop_checker.banned_token_ids(req, 0)):
                self.waiting.append(req)
            else:
                failed.append((req, "the request's grammar allows no first token (with min_new_tokens, its "
                                    "end-of-sequence is banned too): it matches nothing that can be generated"))
        for req, message in failed:
            self._finish(req, FinishReason.abort(message, status_code=400))

    def abort_request(self, rid: str) -> None:
        """Abort in any state; KV goes back through the same path as a finished request's."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self.grammars.discard(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self._finish(req, FinishReason.abort("aborted by request"))

    def flush_cache(self) -> tuple[bool, str]:
        if self.waiting or self.running or self.chunked_req is not None:
            return False, "cannot flush the cache while requests are running or queued"
        self._resolve_inflight()
        self.cache.reset()
        self.speculator.flush()
        self.check_invariants()
        return True, ""

    def server_info(self) -> dict[str, Any]:
        return server_info(self)

    def ready_info(self) -> ModelInfo:
        return ready_info(self)

    # ---- prefill ----------------------------------------------------------------------------------
    def _schedule_prefill(self) -> Optional[ScheduleBatch]:
        if not self.waiting and self.chunked_req is None:
            return None
        rows = self.max_running - (self.chunked_req is not None)
        if (victim := self.fair_share.preemption_victim(self.waiting, self.running, rows)) is not None:
            self._resolve_inflight()
            if victim in self.running:
                self._retract(victim)
        adder = PrefillAdder(
            memory_left=lambda: self.allocator.available_size() + self.cache.evictable_size(),
            running_reserve=sum(min(r.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) for r in self.running)
            * self.new_token_ratio.value,
            new_token_ratio=self.new_token_ratio.value,
            max_prefill_tokens=self.args.max_prefill_tokens,
            chunk_size=self.chunk_size,
            page_size=self.page_size,
        )
        entries: list[tuple[Req, int, int, torch.Tensor]] = []  # (request, prefix_len, extend_len, slots)
        order = self.fair_share.order(self.policy.order(self.waiting), self.running, rows)
        chunked = self.chunked_req
        # Another tenant's short request may go before the next chunk of a long prompt (scheduler/fair_share.py).
        ahead = self.fair_share.ahead_of_chunk(chunked, order, [*self.running, *([chunked] if chunked else [])],
                                               self.max_running, adder.rem_chunk_tokens)
        self._admit_in_order(ahead, adder, entries, rows)
        if chunked is not None and not self._extend(chunked, chunked.kv_len, adder, entries) and not entries:
            return None
        chunk_left_out = chunked is not None and all(entry[0] is not chunked for entry in entries)
        self._admit_in_order([req for req in order if req not in ahead], adder, entries,
                             self.max_running - chunk_left_out)
        if not entries:
            return None
        # What this batch computes goes into the tree now (locked by its requests), so the next batch can share
        # it even before this one has run: any batch that reads it runs after this one.
        for req, *_ in entries:
            self.cache.cache_unfinished_req(req, req.all_ids[: req.kv_len])

        admitted = {id(entry[0]) for entry in entries}
        self.waiting = [req for req in self.waiting if id(req) not in admitted]
        # A chunked request left out of this batch (others went first) keeps its place for the next one.
        self.chunked_req = chunked if chunked is not None and id(chunked) not in admitted else None
        decodes, decode_slots = self._mixed_decodes() if self.args.enable_mixed_chunk else ([], None)
        for req, *_ in entries:
            if req.kv_len < req.fill_len():
                self.chunked_req = req
            else:
                self.running.append(req)
        mode = ForwardMode.MIXED if decodes else ForwardMode.EXTEND
        if logger.isEnabledFor(logging.INFO):
            logger.info(prefill_log_line(len(entries), sum(e[2] for e in entries), sum(e[1] for e in entries),
                                         self._used_tokens(), self.allocator.size, len(self.running),
                                         len(self.waiting)))
        return self._make_batch(mode, entries, decodes, decode_slots)

    def _admit_in_order(self, reqs: list[Req], adder: PrefillAdder, entries: list, rows: int) -> None:
        """Admit waiting requests in the order given while the batch, the running requests and the rows allow."""
        for req in reqs:
            if adder.stopped or len(self.running) + len(entries) >= rows:
                break
            if not self.lora.fits(req, itertools.chain(self.running, (entry[0] for entry in entries))):
                continue
            if self.req_to_token_pool.available_size() == 0 or self._admit(req, adder, entries) is False:
                break

    def _admit(self, req: Req, adder: PrefillAdder, entries: list) -> Optional[bool]:
        """Match `req`'s cached prefix, lock it, take a row and slots for its first (or only) chunk.

        Returns True when admitted, False when the batch is full, None when `req` waits for the next batch
        because a request already in this batch computes a longer part of its prefix.
        """
        fill_len = req.fill_len()
        # Keep at least one token to compute, so the batch yields the logits of the next token.
        key = req.all_ids[: prefix_limit(req, fill_len - 1)]
        match = self.cache.match_prefix(key, req.namespace)
        match = self.cache.load_back(match)  # KV demoted to a lower tier returns to the device before the extend
        if _longest_in_batch_prefix(key, req.namespace, entries) >= match.length + IN_BATCH_PREFIX_MIN_GAIN:
            return None
        self.cache.inc_lock_ref(match.last_node)
        row = self.req_to_token_pool.alloc()
        req.req_pool_idx, req.prefix_indices, req.last_node = row, match.indices, match.last_node
        req.kv_len = match.length
        if match.length:
            table = self.req_to_token_pool.req_to_token
            table[row, : match.length] = match.indices.to(table.device, table.dtype)
        if not self._extend(req, match.length, adder, entries):
            self.cache.dec_lock_ref(match.last_node)
            self.req_to_token_pool.free(row)
            req.reset_kv_state()
            return False
        if req.num_cached_tokens is None:
            req.on_first_admission(match.length)
            self.stats.on_admitted(req.prompt_len, match.length)
        return True

    def _extend(self, req: Req, prefix_len: int, adder: PrefillAdder, entries: list) -> bool:
        """Plan and allocate the next extend of a request that holds a row; False when it does not fit."""
        fill_len = req.fill_len()
        extend_len = adder.plan(req, prefix_len, fill_len)
        if extend_len == 0:
            return False
        slots = allocate_slots(self.allocator, self.cache, self.req_to_token_pool, [req.req_pool_idx],
                               [prefix_len], [extend_len])
        if slots is None:
            adder.stopped = True
            return False
        adder.commit(req, extend_len, fill_len, prefix_len)
        req.kv_len = prefix_len + extend_len
        entries.append((req, prefix_len, extend_len, slots))
        return True

    def _mixed_decodes(self) -> tuple[list[Req], Optional[torch.Tensor]]:
        """Running requests that decode inside this extend batch (and their slots), if all of them fit."""
        reqs = [r for r in self.running
                if r.needs_more_tokens() and not (self.inflight and needs_exact_history(r))]
        slots = self._allocate_decode(reqs) if reqs else None
        return (reqs, slots) if slots is not None else ([], None)

    # ---- decode -----------------------------------------------------------------------------------
    def _schedule_decode(self) -> Optional[ScheduleBatch]:
        reqs = [r for r in self.running if r.needs_more_tokens()]
        if reqs and self.inflight and any(needs_exact_history(r) for r in reqs):
            self._resolve_inflight()
            reqs = [r for r in self.running if r.needs_more_tokens()]
        if (verify := self._schedule_verify(reqs)) is not None:
            return verify
        slots = None
        while reqs and (slots := self._allocate_decode(reqs)) is None:
            if self.inflight:
                # Finishing requests of the batch in flight may free enough; retract only if not.
                self._resolve_inflight()
                reqs = [r for r in self.running if r.needs_more_tokens()]
                continue
            victim = max(reqs, key=lambda r: (r.remaining_new_tokens(), r.kv_len))
            reqs.remove(victim)
            self._retract(victim)
        if not reqs:
            return None
        self.new_token_ratio.decay()
        return self._make_batch(ForwardMode.DECODE, [], reqs, slots)

    def _schedule_verify(self, reqs: list[Req]) -> Optional[ScheduleBatch]:
        """Speculative decoding's decode step (scheduler/speculative/), or None for a plain one."""
        if not reqs:
            return None
        batch = self.speculator.plan(reqs)
        if batch is not None:
            self.new_token_ratio.decay()
        return batch

    def _allocate_decode(self, reqs: list[Req]) -> Optional[torch.Tensor]:
        """One slot for each request's next token (evicting if needed), raising their kv_len; None if short."""
        slots = allocate_slots(self.allocator, self.cache, self.req_to_token_pool,
                               [r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], [1] * len(reqs))
        if slots is not None:
            for req in reqs:
                req.kv_len += 1
        return slots

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its KV goes to the tree, its outputs are kept."""
        self.running.remove(req)
        self._release_kv(req)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio.reset()
        logger.info("retracted request %s (%d outputs so far) to free KV memory", req.rid, len(req.output_ids))

    # ---- batches and results ----------------------------------------------------------------------
    def _make_batch(
        self, mode: ForwardMode, extends: list, decodes: list[Req], decode_slots: Optional[torch.Tensor]
    ) -> ScheduleBatch:
        batch = assemble_batch(mode, extends, decodes, decode_slots, self.stop_checker, self.runner.vocab_size,
                               self.executor.device, self.sampling_reuse)
        batch.input_logprobs = plan_input_logprobs(batch)
        batch.grammar_mask = self.grammars.mask_for(batch)
        batch.prefix_groups = prefix_groups_for(mode, decodes, self.runner.attn_backend)
        self.fair_share.charge_batch(extends, decodes)
        self.stats.on_batch(batch)
        return batch

    def _process_result(self, launched: LaunchedBatch) -> None:
        batch = launched.batch
        try:
            result = launched.result()
        except torch.OutOfMemoryError as error:
            self._fail_batch(batch, error)
            return
        if batch.verify is not None:
            self._process_verify(batch, result)
            return
        collect_input_logprobs(batch, result)
        for i, req in enumerate(batch.reqs):
            req.num_inflight -= 1
            if req.finished:
                self._maybe_release(req)
                continue
            if not batch.samples_output[i]:
                continue  # an unfinished chunk: its sample is not an output
            try:
                self._process_output(req, result, i)
            except Exception as error:  # one request's failure must not take the batch or the server down
                logger.exception("processing the output of request %s failed", req.rid)
                self._finish(req, FinishReason.abort(
                    f"internal error while processing this request's output ({type(error).__name__})", 500))
        # The grammar masks of the batch in flight may have waited for exactly these tokens.
        self.grammars.fill_pending()
        if batch.mode == ForwardMode.DECODE:
            self.stats.decode_steps += 1
            interval = self.args.decode_log_interval
            if interval > 0 and self.stats.decode_steps % interval == 0:
                self._log_decode()

    def _fail_batch(self, batch: ScheduleBatch, error: BaseException) -> None:
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
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        for req in self.reqs.values():
            req.kv_unwritten = req.req_pool_idx is not None  # nothing goes into the tree: it is emptied below
        message = ("the server ran out of device memory while running this request's batch; retry later, or "
                   "lower --mem-fraction-static / --chunked-prefill-size / --cuda-graph-max-bs on the server")
        for req in batch.reqs:
            if not req.finished:
                self._finish(req, FinishReason.abort(message, status_code=503))
        if self.chunked_req is not None and not self.chunked_req.finished:
            self.running.append(self.chunked_req)  # retracted below with the running ones
        self.chunked_req = None
        if self.running:
            logger.warning("%d running requests are retracted and recompute after the failed batch", len(self.running))
        for req in list(self.running):
            self._retract(req)
        for req in list(self.reqs.values()):
            self._maybe_release(req)
        self.cache.reset()
        self.speculator.flush()

    def _process_output(self, req: Req, result: Any, i: int) -> None:
        """Take entry i's sampled token into `req` and finish it if it stops here."""
        if req.max_new_tokens == 0:
            self._finish(req, FinishReason.max_length(0))
            return
        if result.no_token is not None and result.no_token[i]:
            req.ended_without_sample = True
            self._finish(req, FinishReason.abort(
                f"no token satisfies the request's constraints at output position {len(req.output_ids)} (its "
                "grammar, min_new_tokens and banned tokens together allow none)", status_code=400))
            return
        logprob = result.logprobs[i] if result.logprobs is not None else None
        top = result.top_logprobs[i] if result.top_logprobs is not None else None
        reason = self._take_token(req, result.next_token_ids[i], logprob, top)
        if reason is not None:
            self._finish(req, reason)
        elif has_news(req):
            self._news[req.rid] = req

    def _take_token(self, req: Req, token: int, logprob: Optional[float], top: Optional[list]) -> Optional[FinishReason]:
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
                self._finish(req, reason)
            elif req.finished:
                self._maybe_release(req)
            elif has_news(req):
                self._news[req.rid] = req

    def _resolve_inflight(self) -> None:
        self.stats.forced_syncs += bool(self.inflight)
        while self.inflight:
            self._process_result(self.inflight.popleft())

    # ---- finishing and releasing ------------------------------------------------------------------
    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish(reason)
        self.fair_share.on_done(req)
        self.recent_requests.record(req)
        if req in self.running:
            self.running.remove(req)
        self.stats.num_finished += 1
        self.stats.num_aborted += reason.type == "abort"
        self._news[req.rid] = req
        self._maybe_release(req)

    def _maybe_release(self, req: Req) -> None:
        """Release a finished request once no launched batch that includes it is left unprocessed."""
        if req.finished and req.num_inflight == 0 and self.reqs.get(req.rid) is req:
            self._release_kv(req)
            del self.reqs[req.rid]

    def _release_kv(self, req: Req) -> None:
        """The one place a request's KV and row are handed back: KV to the cache, row to the pool."""
        if req.req_pool_idx is not None and req.kv_unwritten:
            # After a failed batch (`_fail_batch`, which empties the tree next): nothing new goes into the tree; the
            # request unlocks its prefix there and frees its own slots.
            kept = len(req.prefix_indices)
            self.cache.cache_finished_req(req, req.all_ids[:kept])
            own_slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, kept:req.kv_len]
            self.allocator.free(own_slots.to(torch.int64))
            self.req_to_token_pool.free(req.req_pool_idx)
        elif req.req_pool_idx is not None:
            token_ids = req.all_ids[: req.kv_len]
            if len(token_ids) < req.kv_len:
                # Only a request whose last step had no token to sample: under overlap the batch after it
                # already computed the next position, from the placeholder id the sampler wrote instead.
                assert req.ended_without_sample, f"{req!r} has KV for tokens it does not know"
                token_ids += [PLACEHOLDER_TOKEN_ID] * (req.kv_len - len(token_ids))
            self.cache.cache_finished_req(req, token_ids)
            self.req_to_token_pool.free(req.req_pool_idx)
        self.speculator.release(req)
        req.reset_kv_state()

    # ---- checks, outputs, logs ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Slot accounting (`total == free + evictable + protected + held`), locks and rows; raises
        AssertionError on any violation. When idle, nothing may be held or protected."""
        held = rows_in_use = 0
        for req in self.reqs.values():
            if req.req_pool_idx is not None:
                rows_in_use += 1
                held += -(-req.held_kv_len() // self.page_size) * self.page_size
        self.cache.check_invariants(held)
        pool = self.req_to_token_pool
        assert pool.available_size() == pool.size - rows_in_use, (
            f"request rows: {pool.size - pool.available_size()} taken, {rows_in_use} held by requests")
        if self.is_idle():
            assert not self.reqs, f"idle scheduler still tracks requests {list(self.reqs)}"
            assert self.cache.protected_size() == 0, "idle scheduler with locked cache nodes"
            total, free = self.allocator.size, self.allocator.available_size()
            assert free + self.cache.evictable_size() == total, "idle scheduler leaked KV slots"
            self.speculator.check_idle()

    def _on_idle(self) -> None:
        self.new_token_ratio.reset()
        if self.args.check_invariants_when_idle and not self._checked_since_work:
            self.check_invariants()
        self._checked_since_work = True

    def _reply(self, message: Any) -> None:
        self._flush_news()  # keep token outputs ahead of the replies that follow them
        self._outputs.append(message)

    def _flush_news(self) -> None:
        if self._news:
            out = build_batch_token_out(self._news.values())
            self._news = {}
            if out is not None:
                self._outputs.append(out)

    def _used_tokens(self) -> int:
        return self.allocator.size - self.allocator.available_size() - self.cache.evictable_size()

    def _log_decode(self) -> None:
        logger.info(decode_log_line(len(self.running), len(self.waiting), self._used_tokens(), self.allocator.size,
                                    self.stats.cache_hit_rate, self.stats.close_window()))

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()


def _longest_in_batch_prefix(key: list[int], namespace: tuple, entries: list) -> int:
    """Longest common prefix of `key` with the tokens computed so far by the batch's requests (same namespace)."""
    best = 0
    for other, *_ in entries:
        if other.namespace == namespace:
            other_ids = other.all_ids
            best = max(best, common_prefix_length(other_ids[: other.kv_len], key, 0, len(key)))
    return best
