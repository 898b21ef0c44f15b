"""The batch executor: forward, sample, and record sampled tokens in the device-side token table.

Without overlap, `launch` runs the batch at once on the calling thread. With overlap, batches run in launch
order on one worker thread (on a GPU, also on their own CUDA stream), so the scheduler thread can build batch
N+1 and process batch N's results while batch N+1 runs. CPU kernels of torch release the GIL, so the two
threads really do work at the same time.

On a GPU the worker only queues a batch: its kernels, the sampled tokens' copy to pinned host memory, and an
event after that copy (`PendingResult`). It does not wait for the device, so it prepares and queues batch
N+1 (inputs, attention plan, graph replay) while batch N still runs, and the device goes from one batch to
the next without waiting for the host. The scheduler thread waits on the event when it takes the result;
`Event.synchronize` releases the GIL, so the worker keeps going meanwhile.

Ordering contract: batches execute strictly one after another in launch order. Everything a batch reads from
the device (KV slots, `req_to_token` rows, the token table) was written on the host before its launch, by an
earlier batch, or by itself (its new K/V, written in each layer before that layer attends). Hence a KV slot
or request row freed by the scheduler can be handed to a later batch without waiting: every batch that used
it has run before that later batch starts.

Besides the sampler's rows, a batch may ask for logits at prompt positions (prompt-token logprobs,
`batch.input_logprobs`), and may carry a grammar mask (`batch.grammar_mask`) that its sampling waits for: under
overlap the scheduler fills it once it has processed the previous batch's tokens (see scheduler/grammar.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.model_runner.cpu.thread_governor import ThreadGovernor
from radixserve.model_runner.logprobs import InputLogprobs, compute_input_logprobs
from radixserve.model_runner.sampling import Sampler
from radixserve.model_runner.verify_forward import VerifyForward
from radixserve.scheduler.batch import ScheduleBatch
from radixserve.scheduler.pooling import PoolingBatch
from radixserve.scheduler.speculative.verify import enqueue_verify

logger = logging.getLogger(__name__)
OOM_ATTEMPTS = 2  # an allocation failure often passes once the caching allocator has released its free blocks


@dataclass
class BatchResult:
    """Host copies of one batch's samples, entry-aligned with `ScheduleBatch.reqs`."""

    next_token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    input_logprobs: Optional[InputLogprobs] = None  # prompt-token logprobs, when the batch planned any
    # Entries where no token could be sampled (see SampleOutput.no_token); None when there are none.
    no_token: Optional[list[bool]] = None
    # Pooling entries' shares of their vectors by batch index (scheduler/pooling.py); None when none pools.
    pooled: Optional[dict[int, torch.Tensor]] = None


@dataclass
class PendingResult:
    """One batch's outputs as queued on the device: host copies that are complete once `copied` has
    fired (None: already complete, as on the CPU)."""

    next_token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor]
    top_logprobs: Optional[tuple[torch.Tensor, torch.Tensor]]  # (values, ids)
    input_logprobs: Optional[InputLogprobs]
    no_token: Optional[torch.Tensor] = None
    copied: Optional[torch.cuda.Event] = None
    pooled: Optional[PoolingShares] = None

    def wait(self) -> BatchResult:
        if self.copied is not None:
            self.copied.synchronize()  # releases the GIL while the device finishes the batch
        result = BatchResult(self.next_token_ids.tolist(), input_logprobs=self.input_logprobs,
                             pooled=None if self.pooled is None else self.pooled.by_entry())
        if self.logprobs is not None:
            result.logprobs = self.logprobs.tolist()
        if self.top_logprobs is not None:
            values, ids = self.top_logprobs
            result.top_logprobs = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        if self.no_token is not None:
            no_token = self.no_token.tolist()
            result.no_token = no_token if any(no_token) else None
        return result


class LaunchedBatch:
    """A batch that was handed to the executor; `result()` waits for it."""

    def __init__(self, batch: ScheduleBatch, future: concurrent.futures.Future) -> None:
        self.batch = batch
        self._future = future

    def result(self) -> BatchResult:
        """The batch's samples; raises `torch.OutOfMemoryError` when the device could not hold the batch (the
        scheduler fails the batch's requests and serves on, see `ResultProcessor.fail_batch` in results.py)."""
        return self._future.result().wait()


class BatchExecutor:
    """Runs ScheduleBatches on a ModelRunner, inline or (overlap) on a worker thread."""

    def __init__(self, runner, overlap: bool) -> None:
        self.runner = runner
        self.device = torch.device(runner.device)
        # Deterministic inference: logprobs that do not depend on the batch (model_runner/sampling.py).
        self.sampler = Sampler(batch_invariant=getattr(getattr(runner, "config", None), "deterministic", False))
        # token_table[row] = the latest token sampled for the request in that req_to_token row.
        self.token_table = torch.zeros(runner.req_to_token_pool.size, dtype=torch.int64, device=self.device)
        self.verify_forward = VerifyForward(runner)  # speculative verify steps, in CUDA graphs where they fit
        self.overlap = overlap
        self._worker = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-forward")
            if overlap else None
        )
        self._stream = torch.cuda.Stream(self.device) if overlap and self.device.type == "cuda" else None
        self.thread_governor = self._thread_governor(runner)

    def _thread_governor(self, runner) -> Optional[ThreadGovernor]:
        """On the CPU, the governor that sizes each step's thread team; None where the count must not move: on a
        GPU, with deterministic inference, under tensor parallelism (the ranks step together), or when disabled."""
        config = getattr(runner, "config", None)
        if (self.device.type != "cpu" or config is None or not config.cpu_thread_governor or config.deterministic
                or config.tp_size > 1 or torch.get_num_threads() == 1):
            return None
        return ThreadGovernor(torch.get_num_threads())

    def launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        if self._worker is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                future.set_result(self.enqueue(batch))
            except torch.OutOfMemoryError as error:  # raised where the worker's future would raise it
                future.set_exception(error)
            return LaunchedBatch(batch, future)
        ready = None
        if self._stream is not None:
            # The worker's stream must see the host thread's writes (req_to_token rows, H2D copies).
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedBatch(batch, self._worker.submit(self._run_on_worker, batch, ready))

    def _run_on_worker(self, batch: ScheduleBatch, ready) -> PendingResult:
        if self._stream is None:
            return self.enqueue(batch)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            return self.enqueue(batch)

    def enqueue(self, batch: ScheduleBatch) -> PendingResult:
        """Queue the batch's forward pass and sampling on the current stream; on a GPU, returns without
        waiting for the device. An allocation that fails (`torch.OutOfMemoryError`) is retried once, after the
        allocator hands its cached blocks back, before any later batch runs; a second failure is raised."""
        if self.thread_governor is not None:  # the CPU: no cached device blocks to hand back and retry with
            with self.thread_governor.step(batch.num_new_tokens):
                return self._enqueue(batch)
        for attempt in range(OOM_ATTEMPTS):
            try:
                return self._enqueue(batch)
            except torch.OutOfMemoryError:
                if attempt == OOM_ATTEMPTS - 1:
                    raise
                logger.warning("out of device memory running a batch of %d requests; retrying it once",
                               len(batch.reqs))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        raise AssertionError("unreachable")

    @torch.inference_mode()
    def _enqueue(self, batch: ScheduleBatch) -> PendingResult:
        runner = self.runner
        forward_batch = batch.to_forward_batch(
            runner.req_to_token_pool, runner.token_to_kv_pool, self.token_table, self.device
        )
        if batch.verify is not None:
            return enqueue_verify(runner, forward_batch, batch.verify, self.token_table, self.verify_forward)
        plan = batch.input_logprobs
        if plan is not None:
            forward_batch.logits_indices = plan.logits_indices(forward_batch.last_token_indices())
        pooling = batch.pooling
        if pooling is not None and pooling.hidden_entries:
            entries = torch.tensor(pooling.hidden_entries, dtype=torch.int64).to(self.device, non_blocking=True)
            logits, pooled = runner.forward_pooled(forward_batch, entries)
        else:
            logits, pooled = runner.forward(forward_batch), None
        if logits is None:  # a model that only pools: every entry pools, nothing is sampled
            return self._pooled_result(batch, pooled)
        input_logprobs = None
        if plan is not None:
            input_logprobs = compute_input_logprobs(logits[batch.batch_size:], plan)
            logits = logits[: batch.batch_size]
        shares = pooling_shares(pooling, logits, pooled)
        if batch.grammar_mask is not None:
            batch.grammar_mask.apply(logits)  # waits for the previous batch's tokens under overlap
        out = self.sampler.sample(logits, batch.sampling_info, batch.return_logprob, batch.top_logprobs_num)
        runner.sync_sampled(out.next_token_ids)
        self.token_table[forward_batch.req_pool_indices] = out.next_token_ids
        if self.device.type != "cuda":
            return PendingResult(out.next_token_ids, out.logprobs, out.top_logprobs, input_logprobs, out.no_token,
                                 pooled=shares)

        top = None if out.top_logprobs is None else tuple(_to_host(t) for t in out.top_logprobs)
        pending = PendingResult(_to_host(out.next_token_ids), _to_host(out.logprobs), top, input_logprobs,
                                _to_host(out.no_token), torch.cuda.Event(),
                                pooled=None if shares is None else shares.to_host())
        pending.copied.record()
        return pending

    def _pooled_result(self, batch: ScheduleBatch, pooled: torch.Tensor) -> PendingResult:
        """The result of a batch of a model that only pools (its entries all take a share; no token)."""
        shares = pooling_shares(batch.pooling, None, pooled)
        no_tokens = torch.zeros(batch.batch_size, dtype=torch.int64)
        if self.device.type != "cuda":
            return PendingResult(no_tokens, None, None, None, pooled=shares)
        pending = PendingResult(no_tokens, None, None, None, copied=torch.cuda.Event(), pooled=shares.to_host())
        pending.copied.record()
        return pending

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


@dataclass
class PoolingShares:
    """The pooling entries' shares of their vectors (scheduler/pooling.py), concatenated into one float32 tensor, so a
    batch copies them to the host at once: entry `entries[i]`'s share is the next `sizes[i]` values."""

    entries: list[int]
    sizes: list[int]
    values: torch.Tensor

    def to_host(self) -> "PoolingShares":
        return PoolingShares(self.entries, self.sizes, self.values.to("cpu", non_blocking=True))

    def by_entry(self) -> dict[int, torch.Tensor]:
        return dict(zip(self.entries, self.values.split(self.sizes)))


def pooling_shares(pooling: Optional[PoolingBatch], logits: Optional[torch.Tensor],
                   pooled: Optional[torch.Tensor]) -> Optional[PoolingShares]:
    """Each pooling entry's share of its vector: its row of `pooled` (embed, classify), or the log-probabilities of its
    label tokens under its row of `logits` (score); None when no entry pools."""
    if pooling is None:
        return None
    entries, sizes, parts = [], [], []
    if pooled is not None:
        entries += pooling.hidden_entries
        sizes += [pooled.shape[1]] * pooled.shape[0]
        parts.append(pooled.reshape(-1))
    if pooling.score_entries:
        assert logits is not None, "score entries need logits"
        logprobs = torch.log_softmax(logits[pooling.score_entries].float(), dim=-1)
        rows = [row for row, labels in enumerate(pooling.score_labels) for _ in labels]
        columns = [label for labels in pooling.score_labels for label in labels]
        device = logprobs.device
        entries += pooling.score_entries
        sizes += [len(labels) for labels in pooling.score_labels]
        parts.append(logprobs[torch.tensor(rows, device=device), torch.tensor(columns, device=device)])
    return PoolingShares(entries, sizes, torch.cat(parts) if len(parts) > 1 else parts[0])


def _to_host(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Into pinned memory, complete once the batch's `copied` event fires."""
    return None if tensor is None else tensor.to("cpu", non_blocking=True)
