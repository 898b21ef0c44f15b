"""The Scheduler: request queues, continuous batching, and the step loop.

One step:  pick the next batch (prefill first, else decode) -> launch it -> process the previous results.

    waiting --admit (policy order, PrefillAdder budgets)--> [chunked] --> running --finish--> released
       ^                                                                     |
       +---------------------------- retract (decode out of memory) ---------+

The step is written here; each decision lives in a part of its own, called from one place:
- Prefill priority (`PrefillPlanner`, prefill.py): when waiting requests fit, the step runs an extend batch (a
  long prompt is cut into chunks over several steps; fair share and priority order the queue); otherwise it
  decodes the running requests (`DecodePlanner`, decode.py, which retracts a request when KV runs out). With
  `enable_mixed_chunk` the running requests ride along in the extend batch as one-token entries (ForwardMode.MIXED).
- Overlap (default): batch N+1 is built and launched before batch N's results are processed (`ResultProcessor`,
  results.py); decode inputs come from the executor's device-side token table, so building never waits for the
  device. A request that finishes in batch N may already sit in batch N+1: its extra token is dropped, and its row
  and KV are released once batch N+1 is processed too (`Req.num_inflight`). The scheduler waits for the batch in
  flight only when it must see its results first: before retracting, and before sampling a request whose
  penalties read its previous token.
- Sharing: the tokens an extend batch computes go into the tree (`cache_unfinished_req`) as soon as the batch
  is built, before it runs: every batch that can read them runs after it. If a request's tokens were already
  in the tree (put there by another request of the same batch), its row is pointed at the tree's copy, which
  that batch writes in the same layer before attending (the AttentionBackend contract: write, then attend).
  A request whose prefix another request of the batch is computing waits one batch rather than compute it too.
- Speculative decoding (scheduler/speculative/, docs/speculative.md): the speculator turns the decode step into a
  verify step that checks each request's draft chain in one extend forward (without speculative decoding the
  speculator is `NoSpeculation`, which plans none); the result processor takes the accepted tokens and the
  speculator frees the rejected drafts' KV before a request may finish. Under overlap a request's verify step waits
  for its previous one (`needs_exact_history`); other batches (prefills) overlap it.
- Post-training (`PostTraining`, weights.py): weight updates retract the running requests and drop the cache; while
  generation is paused or memory is released, no batch runs.
- Release (`RequestLifecycle`, lifecycle.py): a finished, aborted or retracted request hands its KV to the cache
  (`cache_finished_req`, so a retracted request's re-prefill reuses it) and frees its row, in `release_kv` and
  nowhere else.

Messages in (`handle_message`) and outputs out (`take_outputs`) are plain objects, so tests drive a Scheduler
in-process; `process.py` wires it to ZMQ (the loop is loop.py).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

from radixserve.radix_cache.retention import RetainedSessions
from radixserve.runtime.wire.cache_tree import CacheTreeReq, CacheTreeReqOutput
from radixserve.runtime.wire.messages import (
    AbortReq, FinishReason, FlushCacheReq, FlushCacheReqOutput, GetServerInfoReq, GetServerInfoReqOutput, ModelInfo,
    TokenizedGenerateReq,
)
from radixserve.runtime.wire.lora import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from radixserve.runtime.wire.weights import CONTROL_REQUESTS
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.batch_builder import BatchBuilder
from radixserve.scheduler.cache_view import RecentRequests, cache_tree_summary
from radixserve.scheduler.decode import DecodePlanner
from radixserve.scheduler.fair_share import FairShare
from radixserve.scheduler.grammar import GrammarManager
from radixserve.scheduler.info import ready_info, server_info
from radixserve.scheduler.lifecycle import RequestLifecycle
from radixserve.scheduler.lora import LoRAScheduling
from radixserve.scheduler.output import build_batch_token_out
from radixserve.scheduler.overlap import BatchExecutor
from radixserve.scheduler.policy import NewTokenRatio, SchedulePolicy
from radixserve.scheduler.prefill import PrefillPlanner
from radixserve.scheduler.req import Req
from radixserve.scheduler.results import ResultProcessor
from radixserve.scheduler.setup import check_request, make_cache, make_window_release, try_load_tokenizer
from radixserve.scheduler.speculative import make_speculator
from radixserve.scheduler.stats import SchedulerStats
from radixserve.scheduler.stop import StopChecker
from radixserve.scheduler.weights import PostTraining

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_runner: Any = None, tokenizer: Any = None) -> None:
        if model_runner is None:
            from radixserve.model_runner.model_runner import ModelRunner
            from radixserve.model_runner.runner_config import RunnerConfig

            model_runner = ModelRunner(RunnerConfig.from_server_args(server_args))
        self.args = args = server_args
        self.runner = model_runner
        self.req_to_token_pool = pool = model_runner.req_to_token_pool
        self.allocator = allocator = model_runner.allocator
        self.page_size = allocator.page_size
        self.max_running = model_runner.max_running_requests
        # An encoder's KV depends on its whole prompt: it never shares (model_runner/models/bert.py).
        self.cache = cache = make_cache(args, pool, allocator, model_runner.token_to_kv_pool,
                                        shares_kv=model_runner.is_causal,
                                        state_pool=getattr(model_runner, "state_pool", None))
        self.tokenizer = tokenizer if tokenizer is not None else try_load_tokenizer(args, model_runner.model_dir)
        self.stop_checker = StopChecker(model_runner.model_config.eos_token_ids, self.tokenizer)
        self.grammars = GrammarManager(self.tokenizer, model_runner.vocab_size, self.stop_checker.eos_token_ids,
                                       args.grammar_compile_timeout if args.tp_size == 1 else None)
        self.policy = SchedulePolicy(args.schedule_policy, cache, not args.disable_radix_cache, args.random_seed)
        self.fair_share = FairShare.from_server_args(args)
        self.lora = LoRAScheduling(getattr(model_runner, "lora_manager", None))
        self.overlap = args.resolved_overlap_schedule()
        self.executor = BatchExecutor(model_runner, self.overlap)
        self.speculator = make_speculator(args, model_runner, cache, self.stop_checker)
        self.chunk_size = (args.resolved_chunked_prefill_size(model_runner.pooling.is_generation)
                           if model_runner.is_causal else None)
        self.stats = SchedulerStats()
        self.recent_requests = RecentRequests()  # paths of finished requests, for the cache page
        self.new_token_ratio = NewTokenRatio(args.schedule_conservativeness)
        # Retained sessions are kept on the device, or on the host tier when there is one (radix_cache/retention.py).
        budget = cache.retention_budget(allocator.size)
        tenant_quota = budget // 2 if args.retention_quota_tokens is None else args.retention_quota_tokens
        self.retention = RetainedSessions(cache, tenant_quota, budget)

        # The parts of a step (see the module docstring), each given the components it works on.
        self.requests = RequestLifecycle(
            cache=cache, allocator=allocator, req_to_token_pool=pool, speculator=self.speculator,
            fair_share=self.fair_share, recent_requests=self.recent_requests, stats=self.stats,
            new_token_ratio=self.new_token_ratio, retention=self.retention)
        self.results = ResultProcessor(
            requests=self.requests, cache=cache, allocator=allocator, grammars=self.grammars,
            stop_checker=self.stop_checker, speculator=self.speculator, stats=self.stats, device=model_runner.device,
            decode_log_interval=args.decode_log_interval, pooling_method=model_runner.pooling.method,
            window_release=make_window_release(model_runner, cache))
        self.inflight = self.results.inflight  # launched batches whose results are not processed, oldest first
        self.batch_builder = BatchBuilder(
            runner=model_runner, device=self.executor.device, stop_checker=self.stop_checker, grammars=self.grammars,
            fair_share=self.fair_share, stats=self.stats, cache=cache)
        self.decode = DecodePlanner(
            requests=self.requests, cache=cache, allocator=allocator, req_to_token_pool=pool,
            speculator=self.speculator, new_token_ratio=self.new_token_ratio, builder=self.batch_builder,
            results=self.results)
        self.prefill = PrefillPlanner(
            requests=self.requests, cache=cache, allocator=allocator, req_to_token_pool=pool, policy=self.policy,
            fair_share=self.fair_share, lora=self.lora, new_token_ratio=self.new_token_ratio, stats=self.stats,
            builder=self.batch_builder, decode=self.decode, results=self.results, max_running=self.max_running,
            max_prefill_tokens=args.max_prefill_tokens, chunk_size=self.chunk_size,
            mixed_chunk=args.enable_mixed_chunk, pooling_reuses_prefix=model_runner.pooling.reuses_prefix)
        self.post_training = PostTraining(self, args.weight_version)  # weight updates, pause, memory (weights.py)
        self._outputs: list[Any] = []
        self._arrivals = itertools.count()
        self._checked_since_work = True

    # The requests by state live in `self.requests` (lifecycle.py).
    @property
    def waiting(self) -> list[Req]:
        return self.requests.waiting

    @property
    def running(self) -> list[Req]:
        return self.requests.running

    @property
    def chunked_req(self) -> Optional[Req]:
        return self.requests.chunked_req

    @property
    def reqs(self) -> dict[str, Req]:
        """Every request not yet released, by rid."""
        return self.requests.reqs

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
            self.results.process(self.inflight.popleft())
        if self.is_idle():
            self._on_idle()
        return worked

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked_req or self.inflight or self.grammars.num_queued)

    def get_next_batch(self) -> Optional[ScheduleBatch]:
        self._admit_grammar_ready()
        self.retention.expire()  # what ran out is evictable again before admission counts the room
        if self.post_training.holds_batches:  # paused, or memory released
            return None
        return self.prefill.schedule() or self.decode.schedule()

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
        elif isinstance(msg, CONTROL_REQUESTS):
            self._reply(self.post_training.handle(msg))
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
        self.requests.reqs[req.rid] = req
        self.fair_share.on_arrival(req)
        error = (check_request(req, self.runner, self.tokenizer, self.chunk_size) or self.fair_share.check(req)
                 or self.lora.check(req))
        if error is not None:
            self.requests.finish(req, FinishReason.abort(error, status_code=400))
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
            self.requests.finish(req, FinishReason.abort(message, status_code=400))

    def abort_request(self, rid: str) -> None:
        """Abort in any state; KV goes back through the same path as a finished request's."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        requests = self.requests
        if req in requests.waiting:
            requests.waiting.remove(req)
        self.grammars.discard(req)
        if req is requests.chunked_req:
            requests.chunked_req = None
        requests.finish(req, FinishReason.abort("aborted by request"))

    def flush_cache(self) -> tuple[bool, str]:
        if self.waiting or self.running or self.chunked_req is not None:
            return False, "cannot flush the cache while requests are running or queued"
        self.results.resolve_inflight()
        self.retention.release_all()
        self.cache.reset()
        self.speculator.flush()
        self.check_invariants()
        return True, ""

    def server_info(self) -> ServerInfo:
        return server_info(self)

    def ready_info(self) -> ModelInfo:
        return ready_info(self)

    # ---- checks, outputs, logs ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Slot accounting (`total == free + evictable + protected + held`), locks and rows; raises
        AssertionError on any violation. When idle, nothing may be held or protected."""
        held, rows_in_use = self.requests.held_kv(self.page_size)
        self.cache.check_invariants(held)
        pool = self.req_to_token_pool
        assert pool.available_size() == pool.size - rows_in_use, (
            f"request rows: {pool.size - pool.available_size()} taken, {rows_in_use} held by requests")
        if self.is_idle():
            assert not self.reqs, f"idle scheduler still tracks requests {list(self.reqs)}"
            retained = self.retention.retained_size()  # the only locks left are retained sessions'
            assert self.cache.protected_size() == retained, "idle scheduler with locked cache nodes"
            total, free = self.allocator.size, self.allocator.available_size()
            assert free + self.cache.evictable_size() + retained == total, "idle scheduler leaked KV slots"
            self.speculator.check_idle()
        self.allocator.check_window_invariants()  # every window slot free or held by one full slot in use

    def _on_idle(self) -> None:
        self.new_token_ratio.reset()
        if self.args.check_invariants_when_idle and not self._checked_since_work:
            self.check_invariants()
        self._checked_since_work = True

    def _reply(self, message: Any) -> None:
        self._flush_news()  # keep token outputs ahead of the replies that follow them
        self._outputs.append(message)

    def _flush_news(self) -> None:
        if self.requests.news:
            out = build_batch_token_out(self.requests.news.values(), self.post_training.weight_version)
            self.requests.news = {}
            if out is not None:
                self._outputs.append(out)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
