"""Deterministic inference's GPU kernels (model_runner/batch_invariant.py): the batch-invariant GEMM against a float64
reference, with every row's bits the same alone and among others; the triton backend's row-invariant mode (every
query row as a decode row of one split) against the float64 attention reference, also when the rows take several
launches of its scratch; the linear swap and the start-up checks.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first); on a GPU
they are compiled, and benchmarks/gpu_deterministic.sh checks the engine's bits end to end.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from attention_cases import make_case, reference_attention, run_backend  # noqa: E402
from radixserve.kernels.batch_invariant_matmul import BLOCK_M, batch_invariant_linear  # noqa: E402
from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.model_runner.batch_invariant import (  # noqa: E402
    BatchInvariantLinear, check_gpu_deterministic, use_batch_invariant_linears)
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.mark.parametrize("rows,out_features,in_features,bias", [(1, 33, 100, True), (5, 64, 64, False),
                                                                 (BLOCK_M + 7, 130, 200, True)])
def test_linear_against_float64(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    out = batch_invariant_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE)).cpu()
    expected = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    assert (out.double() - expected).abs().max().item() < 1e-4


def test_linear_rows_keep_their_bits_in_any_batch():
    """A row alone, among 3 rows, and at a row offset that puts it in the second tile: the same bits."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g).to(DEVICE)
    batch = torch.randn(BLOCK_M + 9, 160, generator=g).to(DEVICE)
    full = batch_invariant_linear(batch, w)
    row = BLOCK_M + 3
    assert torch.equal(batch_invariant_linear(batch[row:row + 1], w), full[row:row + 1])
    assert torch.equal(batch_invariant_linear(batch[row - 1:row + 2], w)[1], full[row])
    # leading dimensions are kept
    assert batch_invariant_linear(batch.view(1, -1, 160), w).shape == (1, BLOCK_M + 9, 96)


def _row_invariant_backend(num_heads, num_kv_heads, head_dim, max_batch_size=8):
    return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, DEVICE, max_batch_size=max_batch_size,
                                  max_kv_splits=2, row_invariant=True)


@pytest.mark.parametrize("mode,lens", [(ForwardMode.EXTEND, ([0, 7, 20], [5, 19, 3])),
                                       (ForwardMode.MIXED, ([9, 0, 31], [1, 6, 1])),
                                       (ForwardMode.DECODE, ([0, 13, 40], [1, 1, 1]))])
@pytest.mark.parametrize("window", [None, 6])
def test_row_invariant_attention_against_float64(mode, lens, window):
    case = make_case(mode, *lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1, dtype=torch.float32,
                     device=DEVICE, seed=3)
    # max_batch_size 2 x 2 splits: the 27 extend rows take several launches of the scratch
    backend = _row_invariant_backend(4, 2, 16, max_batch_size=2 if mode != ForwardMode.DECODE else 4)
    out = run_backend(backend, case, sliding_window=window)
    if mode == ForwardMode.DECODE:
        assert backend.num_kv_splits(case.batch.batch_size) == 1
    error = (out.double().cpu() - reference_attention(case, sliding_window=window)).abs().max().item()
    assert error < 2e-5, f"max abs error {error}"


def test_swap_keeps_the_weights_and_covers_the_head():
    from radixserve.model_runner.parallel import RowParallelLinear, TPGroup

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 12)
            self.out = RowParallelLinear(12, 8, bias=False, tp=TPGroup.single())
            self.embed = nn.Embedding(20, 8)
            self.lm_head = None
            self.logits_head = None

        @property
        def lm_head_weight(self):
            return self.embed.weight

    model = Tiny().to(DEVICE)
    before = dict(model.named_parameters())
    assert use_batch_invariant_linears(model) == 2
    assert isinstance(model.proj, BatchInvariantLinear) and isinstance(model.out, BatchInvariantLinear)
    after = dict(model.named_parameters())
    for name, param in before.items():  # weight updates find the same tensors under the same names
        assert after[name] is param
    assert model.logits_head.weight is model.embed.weight
    x = torch.randn(3, 8, device=DEVICE)
    expected = nn.functional.linear(x.cpu(), before["proj.weight"].cpu(), before["proj.bias"].cpu())
    assert torch.allclose(model.proj(x).cpu(), expected, atol=1e-5)


def test_gpu_deterministic_refusals(tiny_model_dir):
    from radixserve.model_runner.model_config import ModelConfig
    from radixserve.runtime.wire.server_args import ServerArgs

    with pytest.raises(ValueError, match="mixture of experts"):
        check_gpu_deterministic(ModelConfig.from_path(tiny_model_dir("Qwen3MoeForCausalLM")))
    check_gpu_deterministic(ModelConfig.from_path(tiny_model_dir("LlamaForCausalLM")))
    args = ServerArgs(enable_deterministic_inference=True, device="cuda")
    assert args.resolved_attention_backend() == "triton"
    with pytest.raises(ValueError, match="triton attention backend"):
        ServerArgs(enable_deterministic_inference=True, device="cuda", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="drop --quantization"):
        ServerArgs(enable_deterministic_inference=True, device="cuda", quantization="fp8")
