"""Drive a real Scheduler in-process (no processes, no ZMQ) for the scheduler tests.

`SchedulerDriver` feeds messages, steps the scheduler, checks the invariants after every step, and folds the
BatchTokenOut messages into per-request results while asserting the output contract: a request's tokens
arrive in order, and its finish reason arrives exactly once, in its last message.

Model runners are shared between drivers (`shared_runner`) because loading is the slow part: drivers whose server
arguments give equal `RunnerConfig`s share one. A driver flushes its scheduler's cache on `close()`, handing every KV
slot back, so the next scheduler starts clean. Only one open driver may use a runner at a time.

The suite keeps these runners alive for the whole session, so they are built without the column-panel copy of the
float32 CPU linears (`--cpu-kernels auto,-panel`), which would add a third copy of every weight to each: more than
a 24 GiB machine holds. The tests of the panel kernel turn it on (tests/ops/test_cpu_panel_linear.py, the embedded
model against Hugging Face in tests/model_runner/test_model_forward.py).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.runtime.wire.messages import (
    AbortReq, BatchTokenOut, FlushCacheReq, FlushCacheReqOutput, GetServerInfoReq, GetServerInfoReqOutput,
    SamplingParams, SessionRetention, TokenizedGenerateReq, decode, encode,
)
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.server_info import ServerInfo
from radixserve.scheduler.scheduler import Scheduler

_RUNNERS: "collections.OrderedDict[Any, ModelRunner]" = collections.OrderedDict()
# The suite keeps the runners it used last; an older one is dropped (a driver still using it keeps its own reference),
# so the pytest process holds a few models' weights and KV pools rather than one per setting the suite ever used.
MAX_SHARED_RUNNERS = 3
_UNSHARED = itertools.count()
SUITE_CPU_KERNELS = "auto,-panel"  # see the module docstring


def shared_runner(args: ServerArgs) -> ModelRunner:
    """A runner for `args` whose pools are all free; a new one if the cached one was left dirty (by a failed
    test)."""
    config = RunnerConfig.from_server_args(args)
    # A CPU runner reads these fields only to size a GPU memory plan (and the seed only for dummy weights): drivers
    # that differ in them share one runner, so the suite holds a few runners rather than one per scheduler setting.
    key: Any = dataclasses.replace(config, chunked_prefill_size=None, max_prefill_tokens=0, enable_mixed_chunk=False,
                                   random_seed=0) if config.device == "cpu" and config.model.load_format != "dummy" else config
    if config.enable_lora:
        key = (config, next(_UNSHARED))  # its adapters change with load/unload: never shared
    runner = _RUNNERS.get(key)
    clean = runner is not None and runner.allocator.available_size() == runner.allocator.size and (
        runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size) and (
        getattr(runner.allocator, "window_available_size", int)() == getattr(runner.allocator, "window_size", 0))
    if not clean:
        _RUNNERS.pop(key, None)
        while len(_RUNNERS) >= MAX_SHARED_RUNNERS:
            _RUNNERS.popitem(last=False)
        gc.collect()  # what the dropped runners held goes before the new one allocates
        runner = _RUNNERS[key] = ModelRunner(config)
    _RUNNERS.move_to_end(key)
    return runner


@dataclass
class Result:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_messages: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    embedding: Optional[list[float]] = None  # a pooling request's vector


class SchedulerDriver:
    def __init__(self, model_dir: str, check_every_step: bool = True, tokenizer: Any = None, **server_args: Any):
        server_args.setdefault("device", "cpu")
        server_args.setdefault("cpu_kernels", SUITE_CPU_KERNELS)
        self.args = ServerArgs(model_path=model_dir, **server_args)
        self.runner = shared_runner(self.args)
        self.scheduler = Scheduler(self.args, self.runner, tokenizer=tokenizer)
        self.check_every_step = check_every_step
        self.results: dict[str, Result] = {}
        self.replies: list[Any] = []
        self.num_steps = 0

    # ---- input -------------------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], namespace: tuple = (), return_logprob: bool = False,
               top_logprobs_num: int = 0, stream: bool = True, priority: Optional[int] = None,
               tenant_weight: float = 1.0, lora_name: Optional[str] = None, pooling: Any = None,
               retention: Optional[SessionRetention] = None, **sampling: Any) -> None:
        sampling.setdefault("temperature", 0.0)
        self.results[rid] = Result()
        self.scheduler.handle_message(TokenizedGenerateReq(
            rid=rid, input_ids=list(input_ids), sampling_params=SamplingParams(**sampling), namespace=namespace,
            return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, stream=stream, priority=priority,
            tenant_weight=tenant_weight, lora_name=lora_name, pooling=pooling, retention=retention,
        ))
        self._collect()

    def abort(self, rid: str) -> None:
        self.scheduler.handle_message(AbortReq(rid))
        self._collect()

    def flush_cache(self) -> FlushCacheReqOutput:
        self.scheduler.handle_message(FlushCacheReq(rpc_id="flush"))
        self._collect()
        return self.replies.pop()

    def server_report(self) -> ServerInfo:
        """The scheduler's GetServerInfoReq reply, through the wire's codec."""
        self.scheduler.handle_message(GetServerInfoReq(rpc_id="info"))
        self._collect()
        reply = decode(encode(self.replies.pop()))
        assert isinstance(reply, GetServerInfoReqOutput)
        return reply.info

    def server_info(self) -> dict:
        """The report as `/get_server_info` shows it."""
        return self.server_report().to_dict()

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> None:
        self.scheduler.step()
        self.num_steps += 1
        if self.check_every_step:
            self.scheduler.check_invariants()
        self._collect()

    def run_until_idle(self, max_steps: int = 5000) -> dict[str, Result]:
        for _ in range(max_steps):
            if self.scheduler.is_idle():
                break
            self.step()
        assert self.scheduler.is_idle(), "scheduler did not go idle"
        self.scheduler.check_invariants()
        return self.results

    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in self.results.values()]

    def close(self) -> None:
        """Flush the cache so the shared runner's pools are all free for the next test."""
        assert self.scheduler.is_idle()
        reply = self.flush_cache()
        assert reply.success, reply.message
        allocator = self.runner.allocator
        assert allocator.available_size() == allocator.size
        if hasattr(allocator, "window_size"):  # a sliding-window model's window slots (radix_cache/swa_pool.py)
            assert allocator.window_available_size() == allocator.window_size
        self.scheduler.shutdown()

    # ---- output contract ---------------------------------------------------------------------------
    def _collect(self) -> None:
        for message in self.scheduler.take_outputs():
            if not isinstance(message, BatchTokenOut):
                self.replies.append(message)
                continue
            for i, rid in enumerate(message.rids):
                result = self.results[rid]
                assert result.finish_reason is None, f"{rid} got a message after it finished"
                result.num_messages += 1
                result.output_ids.extend(message.new_token_ids[i])
                reason = message.finish_reasons[i]
                result.finish_reason = None if reason is None else reason.to_dict()
                result.prompt_tokens = message.prompt_tokens[i]
                result.completion_tokens = message.completion_tokens[i]
                result.cached_tokens = message.cached_tokens[i]
                assert result.completion_tokens == len(result.output_ids)
                if message.embeddings:
                    result.embedding = message.embeddings[i]
                if message.output_token_logprobs:
                    result.logprobs.extend(message.output_token_logprobs[i])
                    result.top_logprobs.extend(message.output_top_logprobs[i])
