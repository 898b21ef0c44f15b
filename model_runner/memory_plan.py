"""How a GPU's memory is split at start-up: the weights, a reserve for what the steps allocate, and the KV pool.

The KV pool takes what is left once the reserve is set aside, and the reserve is measured, not guessed: with the
weights loaded, `profile_step_memory` runs the largest steps the scheduler can form on small temporary pools
through the real attention backend and sampler:

- a prefill of `chunked_prefill_size` new tokens (`max_prefill_tokens` without chunking, plus a decode token per
  running request with `--enable-mixed-chunk`) over as many requests as it can hold (one logits row each),
- a decode step of `max_running_requests` requests (eager: the largest batch no CUDA graph covers),

each followed by sampling with top-k, top-p, min-p and top log-probabilities (the sampler's widest path). The
peak the caching allocator reports over those steps is the activation reserve. Beside it: the attention
backend's workspaces (measured as it is built), the decode CUDA graphs (their private pool holds one decode
step's activations, the shared logits buffer and the page-table buffers), the request table, and a margin for
what PyTorch does not see (cuBLAS and NCCL workspaces, kernels loaded later, fragmentation).

`--mem-fraction-static` (weights + KV as a share of the device, SGLang's meaning) and `--max-total-tokens`
override the plan. Either way the plan is logged once at start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.sampling import Sampler
from radixserve.model_runner.sampling_info import SamplingBatchInfo
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool
from radixserve.runtime.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.model_runner.attention.base import AttentionBackend
    from radixserve.model_runner.runner_parts import RunnerParts

logger = logging.getLogger(__name__)

GiB = 1 << 30
MARGIN_MIN_BYTES = 1 * GiB
MARGIN_FRACTION = 0.03  # of the device
# The sampler's widest path: every row sampled with top-k, top-p, min-p and top logprobs.
WIDEST_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.01)
TOP_LOGPROBS = 20


@dataclass(frozen=True)
class StepMemory:
    """Bytes measured by `profile_step_memory`."""

    prefill: int  # the prefill step's peak (forward and sampling), above what was allocated before it
    decode: int  # the same for the decode step
    decode_forward: int  # the decode step's forward alone (what a captured graph holds), its logits included
    workspace: int  # the attention backend's own buffers
    prefill_tokens: int
    decode_batch: int


@dataclass(frozen=True)
class MemoryPlan:
    """Where a device's bytes go (all in bytes except `kv_tokens`)."""

    device_name: str
    total: int
    weights: int
    kv: int
    kv_tokens: int
    activations: int = 0
    workspace: int = 0
    cuda_graphs: int = 0
    request_table: int = 0
    margin: int = 0
    source: str = "profiled"
    state_pool: int = 0  # a hybrid model's recurrent states (model_runner/state_memory.py), taken from the KV budget

    @property
    def reserve(self) -> int:
        return self.activations + self.workspace + self.cuda_graphs + self.request_table + self.margin

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        line = (f"memory plan ({self.source}) on {self.device_name}, {gib(self.total)}: weights {gib(self.weights)}, "
                f"KV pool {gib(self.kv)} ({self.kv_tokens} tokens)")
        if self.state_pool:
            line += f", state pool {gib(self.state_pool)}"
        if self.source == "profiled":
            line += (f", reserve {gib(self.reserve)} (step activations {gib(self.activations)}, attention workspaces "
                     f"{gib(self.workspace)}, CUDA graphs {gib(self.cuda_graphs)}, request table "
                     f"{gib(self.request_table)}, margin {gib(self.margin)})")
        return line


def margin_bytes(total: int) -> int:
    return max(MARGIN_MIN_BYTES, int(total * MARGIN_FRACTION))


def profile_prefill_shape(runner: "RunnerParts", max_running: int) -> tuple[int, int]:
    """(new tokens, requests) of the largest prefill batch the scheduler can form."""
    args = runner.config
    chunk = args.chunked_prefill_size
    tokens = min(chunk, args.max_prefill_tokens) if chunk is not None else args.max_prefill_tokens
    if args.enable_mixed_chunk:
        tokens += max_running
    return tokens, max(1, min(max_running, tokens))


def graph_bytes(runner: "RunnerParts", graph_bs: int, step: StepMemory) -> int:
    """The decode graphs' memory: one decode forward's activations and logits in their private pool (measured
    at `step.decode_batch` >= `graph_bs` requests, scaled down), the logits buffer the graphs copy into, and the
    attention backend's page-table buffers for `graph_bs` requests of a whole context."""
    if graph_bs <= 0:
        return 0
    pages_per_request = -(-runner.context_len // runner.page_size)
    forward = -(-step.decode_forward * graph_bs // step.decode_batch)
    return forward + graph_bs * runner.vocab_size * 4 + graph_bs * pages_per_request * 4


class DeviceMemory:
    """The caching allocator's counters of one device (all zero on the CPU, which keeps none, so the profile's steps
    still run there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        self.synchronize()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.synchronize()
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def release_cached(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


@torch.inference_mode()
def profile_step_memory(runner: "RunnerParts", max_running: int,
                        make_backend: Callable[[], "AttentionBackend"]) -> StepMemory:
    """Run the largest prefill and decode steps (see the module docstring) on temporary pools and return their
    peak memory, with the attention backend `make_backend()` builds over them. Leaves the runner without pools or
    attention backend; the caller builds the real ones."""
    device = runner.device
    config = runner.model_config
    page = runner.page_size
    prefill_tokens, prefill_requests = profile_prefill_shape(runner, max_running)
    rows = max(prefill_requests, max_running)
    per_request = -(-prefill_tokens // prefill_requests)
    width = (per_request // page + 2) * page
    slots = (prefill_requests + max_running) * width + page
    runner.req_to_token_pool = ReqToTokenPool(rows + 1, width, device)
    runner.allocator = KVAllocator(slots, page, device)
    runner.token_to_kv_pool = TokenToKVPool(slots, page, config.num_kv_layers, runner.head_layout.num_kv_heads,
                                            config.head_dim, runner.kv_cache_dtype, device,
                                            config.layer_kv_shapes or None)
    if config.is_hybrid:  # a working state per row and one snapshot slot (the steps write none)
        from radixserve.model_runner.state_memory import make_state_pool

        runner.model.set_state_pool(make_state_pool(config, rows + 1, rows + 2, runner.config, runner.dtype, device))
    runner.max_running_requests = max_running  # the backend sizes its decode buffers by it
    runner.lora_manager = None
    runner.cuda_graph_runner = None
    memory = DeviceMemory(device)
    memory.synchronize()
    before_backend = memory.allocated()
    runner.attn_backend = make_backend()
    runner.attn_backend.warm_up(runner.kv_cache_dtype)
    runner.model.set_attention_backend(runner.attn_backend)
    memory.synchronize()
    workspace = memory.allocated() - before_backend

    sampler = Sampler()
    vocab = runner.vocab_size
    generator = torch.Generator().manual_seed(0)
    lengths = [prefill_tokens // prefill_requests + (i < prefill_tokens % prefill_requests)
               for i in range(prefill_requests)]
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]

    peaks, forward_peaks = [], []
    for mode, batch_rows, prefix_lens, new_ids in (
        (ForwardMode.EXTEND, list(range(prefill_requests)), [0] * prefill_requests, prompts),
        (ForwardMode.DECODE, list(range(max_running)), [0] * max_running, [[1]] * max_running),
    ):
        runner.allocator.clear()
        memory.reset_peak()
        base = memory.allocated()
        extend_lens = [len(ids) for ids in new_ids]
        out_cache_loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, batch_rows, prefix_lens,
                                        extend_lens)
        batch = make_forward_batch(mode, batch_rows, prefix_lens, new_ids, out_cache_loc, runner.req_to_token_pool,
                                   runner.token_to_kv_pool)
        if not runner.pooling.is_generation:  # a model that only pools: its vectors, nothing to sample
            runner.forward_pooled(batch, torch.arange(len(batch_rows), device=device))
            forward_peaks.append(memory.peak() - base)
            peaks.append(forward_peaks[-1])
            del batch, out_cache_loc
            continue
        logits = runner.forward(batch, use_cuda_graph=False)
        forward_peaks.append(memory.peak() - base)
        info = SamplingBatchInfo.build([WIDEST_SAMPLING] * len(batch_rows), [[]] * len(batch_rows), vocab, device)
        sampler.sample(logits, info, return_logprob=True, top_logprobs_num=TOP_LOGPROBS)
        del logits, batch, out_cache_loc, info
        peaks.append(memory.peak() - base)

    runner.model.set_attention_backend(None)
    if config.is_hybrid:
        runner.model.set_state_pool(None)
    del runner.attn_backend, runner.req_to_token_pool, runner.allocator, runner.token_to_kv_pool
    memory.release_cached()
    return StepMemory(prefill=peaks[0], decode=peaks[1], decode_forward=forward_peaks[1], workspace=workspace,
                      prefill_tokens=prefill_tokens, decode_batch=max_running)
