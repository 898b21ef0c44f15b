"""The speculative verify forward (model_runner/verify_forward.py): chains as decode rows, in CUDA graphs.

On the CPU (CI): a verify batch (chains of several lengths on top of cached prefixes) run as one decode row
per chain token gives the logits of the eager extend form, and writes the same K/V; without graphs every
verify step runs eagerly.

On a GPU (skipped without one; `pytest -m gpu tests/speculative/test_verify_forward.py`): verify batches replayed in the
decode graphs give the eager logits (exact and padded row counts, and a batch too large for every graph runs
eagerly), and a Scheduler with n-gram speculation gives the same greedy tokens with graphs as without them,
with overlap on and off, with verify steps really replayed.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
from radixserve.model_runner.verify_forward import VerifyForward, as_decode_rows
from radixserve.runtime.wire.server_args import ServerArgs

from scheduler_driver import SchedulerDriver
from test_cuda_graph import GPU_BACKENDS, GPU_MODEL, gpu_runner
from test_speculative import repetitive_prompts

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


class Chains:
    """Requests with a prefilled prompt each, then verify batches of chains on top (slots allocated fresh for
    every batch, so each batch recomputes the same positions)."""

    def __init__(self, runner: ModelRunner, prompt_lens: list[int], seed: int = 0) -> None:
        self.runner = runner
        generator = torch.Generator().manual_seed(seed)
        self.prompts = [torch.randint(0, runner.vocab_size, (n,), generator=generator).tolist() for n in prompt_lens]
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompt_lens]
        loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, self.rows, [0] * len(prompt_lens),
                              prompt_lens)
        runner.forward(make_forward_batch(ForwardMode.EXTEND, self.rows, [0] * len(prompt_lens), self.prompts,
                                          loc, runner.req_to_token_pool, runner.token_to_kv_pool))
        self.generator = generator

    def verify_batch(self, members: list[int], chain_lens: list[int]) -> ForwardBatch:
        runner = self.runner
        rows = [self.rows[i] for i in members]
        prefix_lens = [len(self.prompts[i]) for i in members]
        chains = [torch.randint(0, runner.vocab_size, (n,), generator=self.generator).tolist() for n in chain_lens]
        loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, rows, prefix_lens, chain_lens)
        return make_forward_batch(ForwardMode.EXTEND, rows, prefix_lens, chains, loc, runner.req_to_token_pool,
                                  runner.token_to_kv_pool)

    def eager_logits(self, batch: ForwardBatch) -> torch.Tensor:
        batch.logits_indices = torch.arange(batch.num_tokens, device=batch.input_ids.device)
        logits = self.runner.forward(batch, use_cuda_graph=False).clone()
        batch.logits_indices = None
        return logits


def kv_at(runner: ModelRunner, loc: torch.Tensor) -> list[torch.Tensor]:
    pool = runner.token_to_kv_pool
    return [buffer[loc].clone() for buffer in pool.k_buffer + pool.v_buffer]


def test_decode_rows_give_the_extend_logits_on_cpu(tiny_model_dir):
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("llama"), device="cpu")))
    chains = Chains(runner, [20, 33, 7])
    batch = chains.verify_batch([0, 1, 2], [3, 5, 1])
    rows = as_decode_rows(batch)
    assert rows.mode == ForwardMode.DECODE and rows.batch_size == 9
    assert rows.req_pool_indices.tolist() == [chains.rows[0]] * 3 + [chains.rows[1]] * 5 + [chains.rows[2]]
    assert rows.seq_lens_cpu == [21, 22, 23, 34, 35, 36, 37, 38, 8] == rows.seq_lens.tolist()
    assert rows.prefix_lens_cpu == [p - 1 for p in rows.seq_lens_cpu] == rows.positions.tolist()
    eager = chains.eager_logits(batch)
    kv_eager = kv_at(runner, batch.out_cache_loc)
    as_rows = runner.forward(rows)
    torch.testing.assert_close(as_rows, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(as_rows.argmax(-1), eager.argmax(-1))
    for want, got in zip(kv_eager, kv_at(runner, batch.out_cache_loc)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    verify = VerifyForward(runner)  # no graphs on the CPU: the extend form, eagerly
    assert verify(chains.verify_batch([1], [4])).shape[0] == 4
    assert verify.num_eager_steps == 1 and verify.num_graph_steps == 0


# ---- GPU (the CUDA graph tests' model, backends and runner) ------------------------------------------


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,tolerance", GPU_BACKENDS)
def test_verify_in_graph_matches_eager(tiny_model_dir, backend, dtype, tolerance):
    runner = gpu_runner(tiny_model_dir("llama", **GPU_MODEL), backend, dtype, cuda_graph_max_bs=16)
    assert runner.cuda_graph_runner is not None and runner.cuda_graph_runner.max_bs == 16
    verify = VerifyForward(runner)
    chains = Chains(runner, [5, 40, 3, 17, 64, 9])
    # Rows: 4 (a captured size), 3 + 5 = 8, 2 + 4 + 6 = 12, 1 + 2 + 3 + 4 = 10 (padded to 12), a shrink to 2
    # after 12 (stale rows must hold padding), 6 * 3 = 18 (larger than every graph: eager).
    cases = [([0], [4]), ([1, 2], [3, 5]), ([0, 3, 4], [2, 4, 6]), ([0, 1, 2, 3], [1, 2, 3, 4]), ([5], [2]),
             ([0, 1, 2, 3, 4, 5], [3] * 6)]
    for members, chain_lens in cases:
        batch = chains.verify_batch(members, chain_lens)
        eager = chains.eager_logits(batch)
        kv_eager = kv_at(runner, batch.out_cache_loc)
        graph_steps = verify.num_graph_steps
        got = verify(batch).clone()
        in_graph = sum(chain_lens) <= 16
        assert verify.num_graph_steps == graph_steps + in_graph, (members, chain_lens)
        scale = eager.abs().max().item()
        torch.testing.assert_close(got, eager, atol=tolerance * scale, rtol=tolerance)
        if dtype == "float32":
            assert torch.equal(got.argmax(-1), eager.argmax(-1))
        for want, have in zip(kv_eager, kv_at(runner, batch.out_cache_loc)):
            torch.testing.assert_close(have.float(), want.float(), atol=tolerance * 4, rtol=tolerance)
        runner.allocator.free(batch.out_cache_loc.cpu())
    assert verify.num_graph_steps == 5 and verify.num_eager_steps == 1


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_speculative_greedy_same_with_and_without_graphs(tiny_model_dir, overlap):
    # The CPU speculative tests' model and prompts (tests/speculative/test_speculative.py), on which drafts are accepted; the
    # triton backend takes its small heads.
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(7, 10)
    outputs, graph_steps = {}, {}
    for graphs in (True, False):
        driver = SchedulerDriver(model_dir, device="cuda", dtype="float32", attention_backend="triton",
                                 max_total_tokens=16384, max_running_requests=16,
                                 cuda_graph_max_bs=64, disable_cuda_graph=not graphs,
                                 disable_overlap_schedule=not overlap, speculative_algorithm="NGRAM")
        for i, prompt in enumerate(prompts):
            driver.submit(f"r{i}", prompt, max_new_tokens=32)
        driver.run_until_idle()
        outputs[graphs] = driver.outputs()
        graph_steps[graphs] = driver.scheduler.executor.verify_forward.num_graph_steps
        assert driver.scheduler.speculator.num_accepted > 0
        driver.close()
    assert outputs[True] == outputs[False]
    assert graph_steps[True] > 0 and graph_steps[False] == 0
