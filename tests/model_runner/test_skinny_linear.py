"""16-bit linears on the skinny GEMM at decode rows (model_runner/skinny_linear.py): which layers take it, and that
their products equal `F.linear`'s.

Off a GPU the swap is checked on a real model's layers and the product falls back to `F.linear` (the kernel itself
is checked against float64 under the Triton interpreter in tests/ops/test_quant_kernels.py); on a GPU the swapped
layers multiply on the kernel up to their measured row count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radixserve.kernels import fp8_skinny_gemm
from radixserve.kernels.split_k import SkinnyConfig
from radixserve.model_runner.parallel import RowParallelLinear, TPGroup
from radixserve.model_runner.skinny_linear import SkinnyLinear, skinny_rows, use_skinny_linears

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
CONFIG = SkinnyConfig(block_n=32, block_k=64, split_k=2, use_dot=False, num_warps=4, num_stages=2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(128, 96, bias=False)
        self.o_proj = RowParallelLinear(64, 128, bias=False, tp=TPGroup.single())
        self.gate = nn.Linear(128, 8, bias=True)
        self.other = nn.Linear(128, 40, bias=False)


def test_only_listed_shapes_are_swapped_and_keep_their_tensors(monkeypatch):
    tuned = {(96, 128): [(1, CONFIG)], (128, 64): [(1, CONFIG), (4, CONFIG)], (8, 128): [(1, CONFIG)]}
    monkeypatch.setattr(fp8_skinny_gemm, "TUNED_16BIT", tuned)
    model = Block().to(torch.bfloat16)
    weights = {name: module.weight for name, module in model.named_children()}
    assert skinny_rows(128, 64) == 4 and skinny_rows(40, 128) == 0
    assert sorted(use_skinny_linears(model)) == ["gate", "o_proj", "qkv_proj"]
    assert isinstance(model.qkv_proj, SkinnyLinear) and model.o_proj.max_rows == 4 and type(model.other) is nn.Linear
    for name, weight in weights.items():  # the same tensors: weight updates reach the swapped layers
        assert getattr(model, name).weight is weight
    assert model.gate.bias is not None
    assert dict(model.named_parameters()).keys() == {"qkv_proj.weight", "o_proj.weight", "gate.weight", "gate.bias",
                                                     "other.weight"}


def test_float32_layers_are_left_alone(monkeypatch):
    monkeypatch.setattr(fp8_skinny_gemm, "TUNED_16BIT", {(96, 128): [(1, CONFIG)]})
    assert use_skinny_linears(Block()) == []


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_products_equal_f_linear(monkeypatch, rows):
    """Up to `max_rows` rows on the kernel (on a GPU), past it (and off a GPU) `F.linear`; with a bias."""
    monkeypatch.setattr(fp8_skinny_gemm, "TUNED_16BIT", {(8, 128): [(4, CONFIG)]})
    torch.manual_seed(rows)
    dtype = torch.bfloat16
    layer = nn.Linear(128, 8, bias=True).to(DEVICE, dtype)
    skinny = SkinnyLinear(layer.weight, layer.bias, skinny_rows(8, 128))
    x = torch.randn(1, rows, 128, device=DEVICE, dtype=dtype)
    expected = (x.double() @ layer.weight.double().T + layer.bias.double()).to(dtype)
    out = skinny(x)
    assert out.shape == (1, rows, 8) and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
