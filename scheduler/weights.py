"""The scheduler's side of post-training (docs/rl.md): weight updates, pause and continue, memory release and resume.

Weight updates (`update_weights_from_disk`, `_from_tensor`, `_from_distributed`):
- the batches in flight finish first (they read the weights);
- with `flush_cache` (the default), KV computed under the old weights is never read again: the running requests
  (and the chunked one) go back to the queue, keeping their outputs, and recompute their prefix under the new weights
  when admitted again; then every tier of the prefix cache is dropped (`cache.reset`, host and disk tiers too). So a
  prompt cached before the update reports 0 cached tokens after it. `flush_cache=False` is the trainer's promise
  that the cache stays valid (a partial update whose last part flushes): nothing is retracted or dropped;
- the weight version moves to the request's `weight_version`, or else to the count of updates so far; every output
  carries the version it was computed with (meta_info's `weight_version`).
A request the runner refuses (an unknown name, a wrong shape) changes no weight; under TP every rank checks and
refuses alike, under DP every replica does (the TokenizerManager reports the first failure).

Pause (`pause_generation`): "abort" finishes every queued and running request with finish_reason abort; "retract"
sends the running ones back to the queue (KV to the tree, outputs kept); "in_place" keeps them as they are. Then no
batch runs until `continue_generation`; requests that arrive meanwhile wait in the queue.

Memory (`release_memory_occupation` / `resume_memory_occupation`, model_runner/memory_occupation.py): releasing the
KV pool needs no request to hold KV (pause with "retract" or "abort" first); it drops the cache, and no batch runs
until the pool is back.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from radixserve.runtime.wire.weights import (
    PAUSE_MODES, ContinueGenerationReq, ControlReqOutput, DestroyWeightsUpdateGroupReq, GetWeightsByNameReq,
    GetWeightsByNameReqOutput, InitWeightsUpdateGroupReq, PauseGenerationReq, ReleaseMemoryOccupationReq,
    ResumeMemoryOccupationReq, UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq,
    check_tags,
)
from radixserve.runtime.tensor_payload import payload_tensor, tensor_payload

logger = logging.getLogger(__name__)


class PostTraining:
    """Answers the requests of runtime/wire/weights.py for one scheduler; `holds_batches` tells the step whether it
    may run a batch."""

    def __init__(self, scheduler: Any, weight_version: str) -> None:
        self.scheduler = scheduler
        self.weight_version = weight_version
        self.num_updates = 0
        self.paused: Optional[str] = None  # the pause mode, while paused
        self.released: set[str] = set()  # the memory tags released

    @property
    def holds_batches(self) -> bool:
        return self.paused is not None or "kv_cache" in self.released or "weights" in self.released

    def handle(self, msg: Any) -> Any:
        try:
            if isinstance(msg, GetWeightsByNameReq):
                return self._get_weights(msg)
            return self._reply(msg, self._dispatch(msg))
        except ValueError as error:
            return self._reply(msg, str(error))
        except OSError as error:  # a checkpoint folder that cannot be read
            return self._reply(msg, f"cannot read the weights: {error}")
        except torch.cuda.OutOfMemoryError as error:  # no memory to take back (resume): the server goes on
            return self._reply(msg, f"{type(msg).__name__} failed: {error}")

    # ---- the requests --------------------------------------------------------------------------------
    def _dispatch(self, msg: Any) -> Optional[str]:
        """Carry out `msg`; returns an error message, or None. ValueError: a request that cannot be honoured."""
        runner = self.scheduler.runner
        if isinstance(msg, UpdateWeightsFromDiskReq):
            if msg.load_format not in (None, "auto", "safetensors"):
                raise ValueError(f"load_format {msg.load_format!r}: weights update from safetensors folders only")
            self._update(lambda: runner.weights.load_from_disk(msg.model_path, msg.load_format), True,
                         msg.weight_version)
        elif isinstance(msg, UpdateWeightsFromTensorReq):
            if msg.load_format not in (None, "auto"):
                raise ValueError(f"load_format {msg.load_format!r}: tensors are taken as they are (None)")
            named = [(payload.name, payload_tensor(payload)) for payload in msg.named_tensors]
            self._update(lambda: runner.weights.load_tensors(named), msg.flush_cache, msg.weight_version)
        elif isinstance(msg, InitWeightsUpdateGroupReq):
            runner.weights.init_group(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                                      msg.group_name, msg.backend)
        elif isinstance(msg, UpdateWeightsFromDistributedReq):
            runner.weights.check_broadcast(msg.names, msg.dtypes, msg.shapes, msg.group_name)
            self._update(lambda: runner.weights.load_tensors(
                runner.weights.receive(msg.names, msg.dtypes, msg.shapes, msg.group_name)), msg.flush_cache,
                msg.weight_version)
        elif isinstance(msg, DestroyWeightsUpdateGroupReq):
            runner.weights.destroy_group(msg.group_name)
        elif isinstance(msg, PauseGenerationReq):
            self._pause(msg.mode)
        elif isinstance(msg, ContinueGenerationReq):
            self.paused = None
        elif isinstance(msg, ReleaseMemoryOccupationReq):
            self._release(check_tags(msg.tags))
        elif isinstance(msg, ResumeMemoryOccupationReq):
            tags = check_tags(msg.tags)
            runner.memory.resume(tags)
            self.released -= set(tags)
        else:
            raise TypeError(f"not a post-training request: {type(msg).__name__}")
        return None

    def _update(self, load: Callable[[], None], flush_cache: bool, weight_version: Optional[str]) -> None:
        if "weights" in self.released:
            raise ValueError("the weights are released; resume_memory_occupation(['weights']) first")
        scheduler = self.scheduler
        scheduler.results.resolve_inflight()  # the batches in flight read the weights
        if flush_cache:
            self._retract_all()
        load()
        if flush_cache:
            scheduler.retention.release_all()  # a retained prefix holds KV of the old weights too
            scheduler.cache.reset()
            scheduler.speculator.flush()
        self.num_updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self.num_updates)
        logger.info("weights updated (version %s)%s", self.weight_version,
                    "; prefix cache dropped" if flush_cache else "")

    def _retract_all(self) -> None:
        """Every request holding KV back to the queue, in its order: running ones, then the chunked one."""
        requests = self.scheduler.requests
        chunked = requests.chunked_req
        for req in list(requests.running):
            requests.retract(req)
        if chunked is not None:
            requests.chunked_req = None
            requests.running.append(chunked)  # retracted as a running request is: KV to the tree, back to the queue
            requests.retract(chunked)

    def _pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        scheduler = self.scheduler
        scheduler.results.resolve_inflight()
        if mode == "abort":
            for rid in list(scheduler.reqs):
                scheduler.abort_request(rid)
        elif mode == "retract":
            self._retract_all()
        self.paused = mode

    def _release(self, tags: list[str]) -> None:
        scheduler = self.scheduler
        already = [tag for tag in tags if tag in self.released]
        if already:
            raise ValueError(f"memory already released: {already}")
        scheduler.results.resolve_inflight()
        if "kv_cache" in tags:
            if scheduler.running or scheduler.chunked_req is not None:
                raise ValueError("requests are running: pause_generation (mode 'retract' or 'abort') before "
                                 "releasing the KV cache")
            scheduler.retention.release_all()
            scheduler.cache.reset()
            scheduler.speculator.flush()
        scheduler.runner.memory.release(tags)
        self.released |= set(tags)

    def _get_weights(self, msg: GetWeightsByNameReq) -> GetWeightsByNameReqOutput:
        if "weights" in self.released:
            return GetWeightsByNameReqOutput(rpc_id=msg.rpc_id, success=False, message="the weights are released")
        try:
            value = self.scheduler.runner.weights.parameter(msg.name, msg.truncate_size)
        except ValueError as error:
            return GetWeightsByNameReqOutput(rpc_id=msg.rpc_id, success=False, message=str(error))
        return GetWeightsByNameReqOutput(rpc_id=msg.rpc_id, success=True, parameter=tensor_payload(msg.name, value))

    def _reply(self, msg: Any, error: Optional[str]) -> ControlReqOutput:
        if error is not None:
            logger.warning("%s refused: %s", type(msg).__name__, error)
        return ControlReqOutput(rpc_id=msg.rpc_id, success=error is None, message=error or "",
                                weight_version=self.weight_version, status_code=200 if error is None else 400)
