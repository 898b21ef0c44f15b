"""The speculative verify forward: logits at every position of every chain, in a CUDA graph where one fits.

A verify batch (scheduler/speculative/verify.py) is an EXTEND batch: entry i is request i's chain
`[t_0, ..., t_k]` at positions `K_i .. K_i + k`, on top of `K_i` positions of KV in its `req_to_token` row, with
logits wanted at every chain position. Row j of that chain attends to positions `0 .. K_i + j` of the request,
which is exactly what a DECODE request of length `K_i + j + 1` on the same `req_to_token` row attends to. So the
chains' rows can run as one decode batch of `sum(k_i + 1)` requests (`as_decode_rows`): every row writes its
K/V to its own slot, and since a layer writes the K/V of the whole batch before it attends (the
AttentionBackend contract), row j sees rows `0 .. j - 1` of its chain.

On a GPU that decode batch replays the decode CUDA graphs already captured for plain decode steps
(model_runner/cuda_graph.py): a verify step of `bs` requests with chains of `L` tokens runs in the graph of the
smallest captured size >= `bs * L`, so the decode buckets are the verify buckets too and no second set of
graphs (or memory) is needed. The cost of this form: each row reads its whole context, `L` times what the
extend kernel reads, which is small next to the weights at the batch sizes graphs cover (up to
`cuda_graph_max_bs` rows). A batch with more rows, or a runner without graphs (the CPU, `--disable-cuda-graph`,
LoRA), runs the extend form eagerly. If a replay raises, the error is logged once and every later verify
step runs eagerly.
"""

from __future__ import annotations

import logging

import torch

from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def as_decode_rows(batch: ForwardBatch) -> ForwardBatch:
    """The EXTEND `batch` as a DECODE batch with one request per new token (see the module docstring)."""
    device = batch.input_ids.device
    rows = torch.repeat_interleave(batch.req_pool_indices, batch.extend_lens)
    prefix_cpu = [p + j for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu) for j in range(e)]
    prefix = torch.tensor(prefix_cpu, dtype=torch.int64, device=device)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=batch.input_ids, positions=batch.positions,
        out_cache_loc=batch.out_cache_loc, req_pool_indices=rows, seq_lens=prefix + 1, prefix_lens=prefix,
        extend_lens=torch.ones_like(prefix), seq_lens_cpu=[p + 1 for p in prefix_cpu], prefix_lens_cpu=prefix_cpu,
        extend_lens_cpu=[1] * len(prefix_cpu), req_to_token_pool=batch.req_to_token_pool,
        token_to_kv_pool=batch.token_to_kv_pool, lora_names=_per_row(batch.lora_names, batch.extend_lens_cpu),
    )


def _per_row(names, extend_lens: list[int]):
    if names is None:
        return None
    return [name for name, count in zip(names, extend_lens) for _ in range(count)]


class VerifyForward:
    """Runs verify batches on one ModelRunner: in its decode CUDA graphs when they fit, else eagerly."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.graphs = getattr(runner, "cuda_graph_runner", None)
        self.num_graph_steps = 0  # verify steps replayed in a graph
        self.num_eager_steps = 0

    def uses_graph(self, batch: ForwardBatch) -> bool:
        return self.graphs is not None and batch.num_tokens <= self.graphs.max_bs and batch.lora_names is None

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[num_tokens, vocab]`, row r for the batch's r-th new token. From a graph they are a
        view of its output buffer: consume them before the next forward."""
        if self.uses_graph(batch):
            rows = as_decode_rows(batch)
            if self.graphs.can_run(rows):
                try:
                    logits = self.runner.forward(rows)
                    self.num_graph_steps += 1
                    return logits
                except Exception:  # never take serving down for an optimisation: run eagerly from now on
                    logger.exception("a verify step failed in a CUDA graph; verify steps run eagerly from now on")
                    self.graphs = None
        batch.logits_indices = torch.arange(batch.num_tokens, device=batch.input_ids.device)
        self.num_eager_steps += 1
        return self.runner.forward(batch, use_cuda_graph=False)
