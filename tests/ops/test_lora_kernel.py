"""The Triton gather-matmul LoRA kernel (kernels/lora_sgmv.py) against the torch path of model_runner/lora/layers.py
and a float64 per-token reference. Without a GPU it runs under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from radixserve.kernels import lora_sgmv  # noqa: E402
from radixserve.model_runner.lora.layers import LoRABatch, segmented_lora  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
assert ON_GPU or isinstance(lora_sgmv._gather_matmul_kernel, InterpretedFunction), "the kernel would not run here"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("in_features, out_features, rank", [(48, 80, 8), (130, 70, 16)])
def test_lora_kernel_matches_the_torch_path_and_float64(dtype, in_features, out_features, rank):
    generator = torch.Generator().manual_seed(in_features)
    slots = [1, 1, -1, 0, 2, 2, 2, -1, 0]
    x = torch.randn(len(slots), in_features, generator=generator)
    a = torch.randn(3, rank, in_features, generator=generator) * 0.3
    b = torch.randn(3, out_features, rank, generator=generator) * 0.3
    token_slots = torch.tensor(slots, dtype=torch.int64)
    groups = [(s, torch.nonzero(token_slots == s).flatten().to(DEVICE)) for s in (0, 1, 2)]
    batch = LoRABatch(groups, len(slots), token_slots.to(DEVICE))
    args = [t.to(DEVICE, dtype) for t in (x, a, b)]
    kernel = lora_sgmv.lora_delta(*args, batch.token_slots)
    reference = segmented_lora(*args, batch)
    expected = torch.zeros(len(slots), out_features, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            expected[t] = b[s].double() @ (a[s].double() @ x[t].double())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(kernel.double().cpu(), expected, rtol=tolerance, atol=tolerance * 10)
    torch.testing.assert_close(kernel.cpu(), reference.cpu(), rtol=tolerance, atol=tolerance * 10)
    assert kernel.dtype == dtype and torch.all(kernel[2] == 0) and torch.all(kernel[7] == 0)
