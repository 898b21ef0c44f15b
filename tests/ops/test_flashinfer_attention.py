"""The FlashInfer attention backend (GPU only) against a float64 reference and torch_native, in bfloat16.

Skips without a CUDA device or without the `flashinfer` package. The first run on a machine JIT-compiles
FlashInfer's kernels (tens of seconds per head_dim / dtype); `benchmarks/gpu_check.py` covers the same
ground with larger random batches and prints a table.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flashinfer")

from attention_cases import kv_written, make_case, reference_attention, run_backend  # noqa: E402
from radixserve.kernels.flashinfer_wrappers import fa3_available  # noqa: E402
from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402

pytestmark = pytest.mark.gpu

HEAD_DIM = 128  # one JIT compile per head_dim and dtype: keep to one
BF16_ATOL = 2e-2

BATCHES = {
    ForwardMode.EXTEND: ([0, 37, 64, 300, 5], [100, 1, 17, 60, 250]),
    ForwardMode.DECODE: ([0, 15, 16, 700, 63, 2], [1, 1, 1, 1, 1, 1]),
    ForwardMode.MIXED: ([40, 0, 129], [1, 33, 1]),
}


def _case(mode, page_size, num_heads, num_kv_heads, seed=0):
    return make_case(mode, *BATCHES[mode], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM,
                     page_size=page_size, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.parametrize("mode", list(BATCHES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (8, 8)])
def test_matches_reference_and_torch_native(mode, page_size, num_heads, num_kv_heads):
    backend = FlashInferAttentionBackend(num_heads, num_kv_heads, HEAD_DIM, torch.bfloat16, "cuda",
                                         page_size=page_size)
    case = _case(mode, page_size, num_heads, num_kv_heads)
    out = run_backend(backend, case)
    assert out.shape == case.q.shape and out.dtype == torch.bfloat16
    assert kv_written(case)
    reference = reference_attention(case, device="cuda")
    error = (out.double() - reference).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"
    native = run_backend(TorchNativeAttention(), _case(mode, page_size, num_heads, num_kv_heads))
    torch.testing.assert_close(out, native, atol=BF16_ATOL, rtol=2e-2)


needs_fa3 = pytest.mark.skipif(not fa3_available(torch.device("cuda"), torch.bfloat16),
                               reason="FlashInfer's FA3 kernels need a Hopper GPU")
LONG_EXTEND = ([0, 37, 300], [300, 129, 200])  # 210 new tokens a request on average: FA3 under "auto"


@needs_fa3
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fa3_extend_matches_reference(mode, page_size):
    backend = FlashInferAttentionBackend(32, 8, HEAD_DIM, torch.bfloat16, "cuda", page_size=page_size,
                                         prefill_backend="fa3")
    case = _case(mode, page_size, 32, 8, seed=5)
    out = run_backend(backend, case)
    assert case.batch.attn_metadata.wrapper is backend._fa3_prefill_wrapper
    error = (out.double() - reference_attention(case, device="cuda")).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


@needs_fa3
def test_auto_runs_long_extends_on_fa3_and_short_ones_on_fa2():
    backend = FlashInferAttentionBackend(32, 8, HEAD_DIM, torch.bfloat16, "cuda", page_size=1)
    backend.warm_up(torch.bfloat16)
    for (prefix_lens, extend_lens), fa3 in ((LONG_EXTEND, True), (BATCHES[ForwardMode.EXTEND], False)):
        case = make_case(ForwardMode.EXTEND, prefix_lens, extend_lens, num_heads=32, num_kv_heads=8,
                         head_dim=HEAD_DIM, page_size=1, dtype=torch.bfloat16, device="cuda", seed=6)
        out = run_backend(backend, case)
        chosen = case.batch.attn_metadata.wrapper
        assert chosen is (backend._fa3_prefill_wrapper if fa3 else backend._prefill_wrapper)
        error = (out.double() - reference_attention(case, device="cuda")).abs().max().item()
        assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


def test_prefill_backend_is_checked():
    with pytest.raises(ValueError, match="auto, fa2 or fa3"):
        FlashInferAttentionBackend(8, 2, HEAD_DIM, torch.bfloat16, "cuda", prefill_backend="fa4")


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_layer_scaling_other_than_planned(mode):
    backend = FlashInferAttentionBackend(8, 2, HEAD_DIM, torch.bfloat16, "cuda", page_size=1)
    case = _case(mode, 1, 8, 2, seed=3)
    case.scaling = 0.05
    out = run_backend(backend, case)
    error = (out.double() - reference_attention(case, device="cuda")).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


@pytest.mark.parametrize("batch_size", [8, 40])
def test_graph_decode_plan_matches_reference(batch_size):
    """A CUDA-graph decode wrapper, planned as for a capture, at a batch that FlashInfer's graph-mode planner
    splits over the keys (8 requests) and at one where every request is a single chunk (40 requests x 8 KV
    heads fill more than 2 CTAs per SM of an H200)."""
    backend = FlashInferAttentionBackend(32, 8, HEAD_DIM, torch.bfloat16, "cuda", page_size=1)
    generator = torch.Generator().manual_seed(5)
    prefix_lens = torch.randint(0, 900, (batch_size,), generator=generator).tolist()
    case = make_case(ForwardMode.DECODE, prefix_lens, [1] * batch_size, num_heads=32, num_kv_heads=8,
                     head_dim=HEAD_DIM, page_size=1, dtype=torch.bfloat16, device="cuda", seed=7)
    backend.init_cuda_graph_state(batch_size, max(prefix_lens) + 1)
    backend.plan_for_capture(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch)
    error = (out.double() - reference_attention(case, device="cuda")).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


@pytest.mark.parametrize("mode", list(BATCHES))
def test_window_layer_reads_and_writes_window_slots(mode):
    """A window layer whose KV sits in a slot space of its own (radix_cache/swa_pool.py, page size 1): planned over
    the window slots, the new K/V written there."""
    from attention_cases import with_window_slots

    window = 32
    backend = FlashInferAttentionBackend(8, 8, HEAD_DIM, torch.bfloat16, "cuda", page_size=1,
                                         sliding_windows=(window,))
    case = _case(mode, 1, 8, 8)
    expected = reference_attention(case, device="cuda", sliding_window=window)
    with_window_slots(case, window)
    out = run_backend(backend, case, window)
    error = (out.double() - expected).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"
    assert kv_written(case)


@needs_fa3
def test_a_head_size_without_fa3_kernels_prefills_on_fa2():
    """FA3's prefill kernels exist for head sizes 64, 128 and 256 only: a model of another (16 here) prefills on FA2
    under "auto", and asking for fa3 is refused before anything compiles."""
    backend = FlashInferAttentionBackend(4, 4, 16, torch.bfloat16, "cuda", page_size=1)
    assert backend._fa3_prefill_wrapper is None
    with pytest.raises(ValueError, match="head size"):
        FlashInferAttentionBackend(4, 4, 16, torch.bfloat16, "cuda", page_size=1, prefill_backend="fa3")
