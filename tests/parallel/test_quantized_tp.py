"""Quantized checkpoints sharded over two CPU ranks (gloo): each rank cuts its part of the 4-bit and FP8 layouts
(q/k/v and gate/up by output features, o and down by input features, GPTQ's act-order groups kept whole) and the
group gives the greedy ids of one rank. A block-scaled FP8 weight whose shard would split a 128-row block is refused
with the reason."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model_runner"))

from quant_checkpoints import TINY_QUANT_LLAMA, compressed_tensors_checkpoint, int4_checkpoint  # noqa: E402
from test_tensor_parallel import MAX_NEW_TOKENS, _prompts, _run_group  # noqa: E402

from radixserve.model_runner.model_runner import ModelRunner  # noqa: E402
from radixserve.model_runner.quantization import QuantizedLinear  # noqa: E402
from radixserve.model_runner.runner_config import RunnerConfig  # noqa: E402
from radixserve.model_runner.static_generate import greedy_generate  # noqa: E402
from radixserve.runtime.wire.server_args import ServerArgs  # noqa: E402


def one_rank(model_dir: str, split_row_parallel_inputs: bool = False) -> list[list[int]]:
    """Greedy ids on one rank; with `split_row_parallel_inputs`, the o and down projections multiply each half of
    their input on its own (its own activation scales) and add, as two ranks do."""
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        model_path=model_dir, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8)))
    if split_row_parallel_inputs:
        for layer in runner.model.model.layers:
            layer.self_attn.o_proj = InHalves(layer.self_attn.o_proj)
            layer.mlp.down_proj = InHalves(layer.mlp.down_proj)
    return greedy_generate(runner, _prompts(runner.vocab_size), MAX_NEW_TOKENS)


class InHalves(torch.nn.Module):
    def __init__(self, layer: QuantizedLinear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        weight, method = self.layer.weight_value, self.layer.method
        return sum(method.apply(weight.narrow(1, start, half), x[:, start:start + half].contiguous(), None)
                   for start in (0, half))


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir):
    return tiny_model_dir("llama", **TINY_QUANT_LLAMA)


@pytest.mark.slow
def test_two_ranks_give_one_ranks_greedy_ids(tmp_path_factory, base_dir):
    """GPTQ with act-order: the same arithmetic on one rank or two, so the same ids. FP8 with per-token activations:
    each rank of a row-parallel projection (o, down) scales its own half of the input (as SGLang and vLLM do), which
    rounds otherwise than one rank: two ranks give the ids of one rank that quantizes each half on its own."""
    gptq = str(tmp_path_factory.mktemp("gptq"))
    int4_checkpoint(base_dir, gptq, str(tmp_path_factory.mktemp("gptq-ref")), "gptq", act_order=True)
    fp8 = str(tmp_path_factory.mktemp("fp8"))
    compressed_tensors_checkpoint(base_dir, fp8, str(tmp_path_factory.mktemp("fp8-ref")), "fp8-channel")
    sharded_gptq, sharded_fp8 = _run_group(2, [gptq, fp8])
    assert sharded_gptq == one_rank(gptq)
    assert sharded_fp8 == one_rank(fp8, split_row_parallel_inputs=True)


def test_a_shard_that_splits_an_fp8_block_is_refused(tmp_path_factory, base_dir):
    block = str(tmp_path_factory.mktemp("fp8-block"))
    compressed_tensors_checkpoint(base_dir, block, str(tmp_path_factory.mktemp("fp8-block-ref")), "fp8-block")
    with pytest.raises(AssertionError, match="cannot be split at .* block boundary"):
        _run_group(2, [block])  # each rank's one KV head is 64 rows of a 128-row block
