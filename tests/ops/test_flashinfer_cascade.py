"""Cascade decode attention on FlashInfer (model_runner/attention/flashinfer_cascade.py), GPU only: groups of requests
that hold the same KV slots for a prefix read it once, and the result equals plain decode attention (a float64
reference, FlashInfer without groups, torch_native).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from attention_cases import make_case, run_backend  # noqa: E402
from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from radixserve.model_runner.attention.flashinfer_cascade import CascadeMetadata  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode, PrefixGroups  # noqa: E402
from test_attention_shared_prefix import GROUP_LENS, LAYER, LAYOUTS, build, reference  # noqa: E402

pytestmark = pytest.mark.gpu

HEAD_DIM = 128
BF16_ATOL = 2e-2


def _backend(num_heads, num_kv_heads, page_size, **overrides):
    backend = FlashInferAttentionBackend(num_heads, num_kv_heads, HEAD_DIM, torch.bfloat16, "cuda",
                                         page_size=page_size)
    for name, value in overrides.items():
        setattr(backend, name, value)
    return backend


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (8, 8)])
def test_cascade_matches_float64_reference(page_size, num_heads, num_kv_heads):
    batch, q, k, v = build(ForwardMode.DECODE, page_size, num_heads, num_kv_heads, torch.bfloat16, seed=5,
                           head_dim=HEAD_DIM, device="cuda")
    layout = LAYOUTS[ForwardMode.DECODE]
    batch.prefix_groups = PrefixGroups(
        members=[[i for i, (group, _, _) in enumerate(layout) if group == name] for name in GROUP_LENS],
        lengths=list(GROUP_LENS.values()))
    backend = _backend(num_heads, num_kv_heads, page_size, cascade_min_saved_bytes=0)
    backend.warm_up(torch.bfloat16)  # what a model runner does at start-up: a real batch's plans come after it
    backend.plan(batch)
    assert isinstance(batch.attn_metadata, CascadeMetadata)
    scaling = HEAD_DIM ** -0.5
    out = backend.forward(q, k, v, LAYER, scaling, batch)
    expected = reference(batch, q.cpu(), k.cpu(), v.cpu(), scaling)
    error = (out.double().cpu() - expected).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


def _large_shared_case(page_size, num_heads, num_kv_heads):
    """20 decoding requests of 600-847 positions: rows 0-7 share row 0's first 512 slots, rows 8-15 row 8's first
    256; rows 16-19 share nothing."""
    prefix_lens = [600 + 13 * i for i in range(20)]
    case = make_case(ForwardMode.DECODE, prefix_lens, [1] * 20, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=HEAD_DIM, page_size=page_size, dtype=torch.bfloat16, device="cuda", seed=7,
                     keep_reference_data=False)
    table = case.batch.req_to_token_pool.req_to_token
    rows = case.batch.req_pool_indices.tolist()
    for first, last, length in ((0, 8, 512), (8, 16, 256)):
        for i in range(first + 1, last):
            table[rows[i], :length] = table[rows[first], :length]
    groups = PrefixGroups(members=[list(range(0, 8)), list(range(8, 16))], lengths=[512, 256])
    return case, groups


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (28, 4)])
def test_cascade_equals_plain_decode(page_size, num_heads, num_kv_heads):
    case, groups = _large_shared_case(page_size, num_heads, num_kv_heads)
    plain = run_backend(_backend(num_heads, num_kv_heads, page_size), case)
    native = run_backend(TorchNativeAttention(min_shared_prefix=10 ** 9), case)
    case.batch.prefix_groups = groups
    backend = _backend(num_heads, num_kv_heads, page_size, cascade_min_saved_bytes=0)
    cascade = run_backend(backend, case)
    assert backend.num_cascade_batches == 1
    torch.testing.assert_close(cascade, plain, atol=BF16_ATOL, rtol=2e-2)
    torch.testing.assert_close(cascade, native, atol=BF16_ATOL, rtol=2e-2)


def test_small_savings_keep_plain_decode_and_graphs():
    case, groups = _large_shared_case(1, 32, 8)
    case.batch.prefix_groups = groups
    backend = _backend(32, 8, 1)  # default thresholds: 2,560 positions x 2 layers saved is far below them
    run_backend(backend, case)
    assert backend.num_cascade_batches == 0 and not backend.prefers_eager(case.batch)
    off = _backend(32, 8, 1, cascade=False, cascade_min_saved_bytes=0)
    run_backend(off, case)
    assert off.num_cascade_batches == 0
