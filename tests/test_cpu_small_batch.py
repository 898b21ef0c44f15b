"""float32 few-row linears on pre-packed oneDNN weights (model_runner/cpu_small_batch.py): the same products as
`F.linear` (exactly so outside the packed row range), installed by the runner when speculative decoding is on or
the packed copy is small next to the machine's memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model_runner import cpu_small_batch
from radixserve.model_runner.cpu_small_batch import (
    MAX_PACKED_ROWS, MIN_PACKED_ROWS, SmallBatchLinear, small_batch_packing_supported,
)
from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
from radixserve.runtime.wire.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not small_batch_packing_supported(), reason="needs oneDNN float32 linears")


@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_linear_matches_linear(bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=generator)
    bias_t = torch.randn(200, generator=generator) if bias else None
    packed = SmallBatchLinear(weight, bias_t)
    for rows in [1, 2, MIN_PACKED_ROWS, 6, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 300]:
        x = torch.randn(rows, 96, generator=generator)
        want = F.linear(x.double(), weight.double(), None if bias_t is None else bias_t.double()).float()
        got = packed(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if not MIN_PACKED_ROWS <= rows <= MAX_PACKED_ROWS:
            assert torch.equal(got, F.linear(x, weight, bias_t))  # outside the range: F.linear itself
    x = torch.randn(2, 3, 96, generator=generator)  # leading dimensions are kept
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias_t), rtol=1e-5, atol=1e-5)


def test_runner_packs_when_speculating_or_small_and_logits_agree(tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama")
    small = ModelRunner(ServerArgs(model_path=model_dir, device="cpu"))  # a few MB: packed by default
    assert isinstance(small.model.model.layers[0].mlp.down_proj, SmallBatchLinear)
    monkeypatch.setattr(cpu_small_batch, "MAX_EXTRA_MEMORY_FRACTION", 0.0)  # as for a model too large to copy
    plain = ModelRunner(ServerArgs(model_path=model_dir, device="cpu"))
    spec = ModelRunner(ServerArgs(model_path=model_dir, device="cpu", speculative_algorithm="NGRAM"))
    assert spec.model.logits_head is not None and plain.model.logits_head is None
    assert isinstance(spec.model.model.layers[0].mlp.down_proj, SmallBatchLinear)
    tokens = list(range(3, 40))
    logits = []
    for runner in (plain, spec):
        row = runner.req_to_token_pool.alloc()
        slots = assign_kv_slots(runner.allocator, runner.req_to_token_pool, [row], [0], [len(tokens)])
        # A verify-sized chain: 30 positions of prefix, then 7 new tokens with logits at each.
        prefix = make_forward_batch(ForwardMode.EXTEND, [row], [0], [tokens[:30]], slots[:30],
                                    runner.req_to_token_pool, runner.token_to_kv_pool)
        runner.forward(prefix)
        chain = make_forward_batch(ForwardMode.EXTEND, [row], [30], [tokens[30:]], slots[30:],
                                   runner.req_to_token_pool, runner.token_to_kv_pool,
                                   logits_indices=torch.arange(7))
        logits.append(runner.forward(chain))
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
