"""The GPU memory plan: the KV pool takes what the profiled steps leave (model_runner/memory_plan.py).

On the CPU (CI): the profiled steps run through a real runner (CPU and torch-native attention, paged KV); the
largest prefill the plan profiles follows the chunk, the prefill budget and mixed chunks;
the graphs' share scales with their batch and counts the logits buffer and page tables; the plan's log line
names every part.

On a GPU (skipped without one): a runner with default settings logs a profiled plan whose parts add up to no more
than the device; the largest prefill and decode batches then run without running out of memory, also with
CUDA graphs; `--mem-fraction-static` still sets the pool instead.
"""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest
import torch

from radixserve.model_runner.memory_plan import GiB, MemoryPlan, StepMemory, graph_bytes, profile_prefill_shape
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.runtime.wire.model_files import ModelFiles
from radixserve.runtime.wire.server_args import ServerArgs

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _runner(**args) -> SimpleNamespace:
    config = RunnerConfig.from_server_args(ServerArgs(device="cuda", **args), ModelFiles("-", "dummy", "-"))
    return SimpleNamespace(config=config, context_len=4096, page_size=16, vocab_size=1000)


def test_the_profiled_prefill_is_the_largest_the_scheduler_forms():
    assert profile_prefill_shape(_runner(), 256) == (8192, 256)  # the GPU's default chunk
    assert profile_prefill_shape(_runner(chunked_prefill_size=2048), 4096) == (2048, 2048)
    assert profile_prefill_shape(_runner(chunked_prefill_size=-1, max_prefill_tokens=5000), 64) == (5000, 64)
    assert profile_prefill_shape(_runner(chunked_prefill_size=-1, max_prefill_tokens=5000, enable_mixed_chunk=True),
                                 64) == (5064, 64)


def test_the_graphs_share_scales_with_their_batch():
    step = StepMemory(prefill=0, decode=0, decode_forward=1000 * 100, workspace=0, prefill_tokens=0, decode_batch=100)
    runner = _runner()
    pages = 4096 // 16
    assert graph_bytes(runner, 0, step) == 0
    assert graph_bytes(runner, 50, step) == 50 * 1000 + 50 * 1000 * 4 + 50 * pages * 4
    assert graph_bytes(runner, 100, step) == 100 * 1000 + 100 * 1000 * 4 + 100 * pages * 4


def test_the_plan_line_names_every_part():
    plan = MemoryPlan("H100", 80 * GiB, 15 * GiB, 50 * GiB, 400_000, activations=2 * GiB, workspace=GiB // 2,
                      cuda_graphs=GiB, request_table=GiB // 4, margin=int(2.4 * GiB))
    assert plan.reserve == int((2 + 0.5 + 1 + 0.25 + 2.4) * GiB)
    line = plan.describe()
    for part in ("weights 15.00 GiB", "KV pool 50.00 GiB (400000 tokens)", "step activations 2.00 GiB",
                 "CUDA graphs 1.00 GiB", "margin 2.40 GiB", "profiled"):
        assert part in line, line


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_the_profiled_steps_run_on_a_real_runner(tiny_model_dir, backend):
    """The profile's prefill and decode (with the widest sampling) run through a real runner and backend; the
    runner is left without pools or backend, as the plan expects. (A CPU keeps no allocator counters: bytes are 0.)"""
    from radixserve.model_runner.memory_plan import profile_step_memory
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig

    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("llama"), device="cpu",
        chunked_prefill_size=96, max_running_requests=16, page_size=4, attention_backend=backend)))
    step = profile_step_memory(runner, 16, runner._create_attention_backend)
    assert (step.prefill_tokens, step.decode_batch) == (96, 16)
    assert runner.max_running_requests == 16
    for name in ("attn_backend", "req_to_token_pool", "allocator", "token_to_kv_pool"):
        assert not hasattr(runner, name), name


# ---- on a GPU ------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _device_memory_back():
    """Each GPU test sizes its pool by the free device memory: the runner of the test before must be gone."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


GPU_MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=128, max_position_embeddings=2048, vocab_size=32000)


@needs_gpu
@pytest.mark.gpu
def test_the_default_plan_holds_the_largest_steps(tiny_model_dir, caplog):
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.sampling import Sampler
    from radixserve.model_runner.sampling_info import SamplingBatchInfo
    from radixserve.model_runner.memory_plan import WIDEST_SAMPLING
    from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
    from radixserve.model_runner.forward_batch import ForwardMode

    model_dir = tiny_model_dir("llama", **GPU_MODEL)
    with caplog.at_level(logging.INFO, logger="radixserve.model_runner.memory_sizing"):
        runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cuda",
            dtype="bfloat16", chunked_prefill_size=4096, max_running_requests=512)))
    plan = runner.memory_plan
    assert plan.source == "profiled" and any("memory plan (profiled)" in r.message for r in caplog.records)
    assert plan.weights + plan.kv + plan.reserve <= plan.total
    assert plan.kv_tokens == runner.max_total_num_tokens and plan.activations > 0 and plan.cuda_graphs > 0
    # The largest steps the scheduler can form run in what the plan left: the tensors they allocate in what the
    # plan reserved for them, and everything the device gives out besides (kernel modules loaded on first use,
    # library workspaces, the allocator's rounding) within the margin on top.
    torch.cuda.synchronize()
    free_before, allocated_before = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rows = [runner.req_to_token_pool.alloc() for _ in range(512)]
    lengths = [8] * 512
    loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, rows, [0] * 512, lengths)
    batch = make_forward_batch(ForwardMode.EXTEND, rows, [0] * 512, [[3] * 8] * 512, loc,
                               runner.req_to_token_pool, runner.token_to_kv_pool)
    with torch.inference_mode():  # as the scheduler's executor runs a step
        logits = runner.forward(batch)
        info = SamplingBatchInfo.build([WIDEST_SAMPLING] * 512, [[]] * 512, runner.vocab_size, runner.device)
        Sampler().sample(logits, info, return_logprob=True, top_logprobs_num=20)
    torch.cuda.synchronize()
    step_tensors = torch.cuda.max_memory_allocated() - allocated_before
    step_device = free_before - torch.cuda.mem_get_info()[0]
    assert step_tensors < plan.reserve - plan.margin, (step_tensors, plan.describe())
    assert step_device < plan.reserve, (step_device, plan.describe())


@needs_gpu
@pytest.mark.gpu
def test_mem_fraction_static_still_sets_the_pool(tiny_model_dir):
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig

    model_dir = tiny_model_dir("llama", **GPU_MODEL)
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cuda",
        dtype="bfloat16", mem_fraction_static=0.3, disable_cuda_graph=True)))
    plan = runner.memory_plan
    assert plan.source == "mem_fraction_static=0.3"
    assert plan.weights + plan.kv <= 0.3 * plan.total
