"""Attention sinks (gpt-oss) in every CPU-testable backend against a float64 reference.

A sink is one learned logit per head that joins every softmax's denominator and carries no value
(attention_cases.reference_attention with `sinks`). torch_native and the C++ CPU kernel run here, over full and
windowed layers and over shared prefixes (cascade attention, whose merge must carry the log-sum-exp); Triton under its
interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 first), compiled on a GPU; FlashInfer on a GPU only
(the last tests here, in bfloat16 at gpt-oss's head_dim of 64; benchmarks/gpu_gpt_oss.sh runs them).
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_cases import make_case, reference_attention, run_backend, share_prefixes
from test_attention_sliding_window import cpu_kernels  # noqa: F401  (the fixture that builds the CPU kernels)
from radixserve.model_runner.attention.base import apply_sinks
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend
from radixserve.model_runner.attention.torch_native import TorchNativeAttention
from radixserve.model_runner.forward_batch import ForwardMode

# (mode, prefix_lens, extend_lens, window or None)
CASES = [
    (ForwardMode.DECODE, [0, 5, 31, 40], [1] * 4, None),
    (ForwardMode.DECODE, [3, 70, 20], [1] * 3, 16),
    (ForwardMode.EXTEND, [0, 12], [37, 9], None),
    (ForwardMode.EXTEND, [40, 0, 3], [30, 5, 33], 8),
    (ForwardMode.MIXED, [10, 64, 0], [1, 20, 1], None),
]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def _sinks(seed: int = 0) -> torch.Tensor:
    # Of the scores' order of magnitude, so the sink takes a real share of the mass (some heads most of it).
    return (torch.randn(NUM_HEADS, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0).float()


def _case(mode, prefix_lens, extend_lens, dtype=torch.float32, device="cpu"):
    return make_case(mode, prefix_lens, extend_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                     head_dim=HEAD_DIM, page_size=1, dtype=dtype, device=device, seed=sum(prefix_lens) + 1)


def test_apply_sinks_is_a_softmax_with_one_more_logit():
    scores = torch.randn(5, 3, 11, dtype=torch.float64)
    values = torch.randn(5, 3, 11, 8, dtype=torch.float64)
    sinks = torch.randn(3, dtype=torch.float64)
    plain = torch.einsum("thk,thkd->thd", torch.softmax(scores, -1), values)
    with_sink = torch.softmax(torch.cat([scores, sinks[None, :, None].expand(5, 3, 1)], -1), -1)[..., :-1]
    expected = torch.einsum("thk,thkd->thd", with_sink, values)
    lse = torch.logsumexp(scores, -1)
    torch.testing.assert_close(apply_sinks(plain, lse, sinks), expected)
    torch.testing.assert_close(apply_sinks(plain, lse / math.log(2.0), sinks, lse_base2=True), expected)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", CASES)
@pytest.mark.parametrize("chunk_pairs", [None, 0, math.inf])  # default chunks, request by request, one padded call
def test_torch_native(mode, prefix_lens, extend_lens, window, chunk_pairs):
    case = _case(mode, prefix_lens, extend_lens)
    sinks = _sinks()
    expected = reference_attention(case, sliding_window=window, sinks=sinks)
    backend = TorchNativeAttention(max_chunk_pairs=chunk_pairs, max_padding_waste=math.inf if chunk_pairs else None)
    out = run_backend(backend, case, window, sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    # The sinks change the output: the check above would not pass without them.
    assert (expected - reference_attention(case, sliding_window=window)).abs().max() > 1e-2


def test_torch_native_shared_prefixes_carry_the_merged_log_sum_exp():
    """Cascade attention merges two partial softmaxes; the sink must see the merged mass of both."""
    case = share_prefixes(_case(ForwardMode.DECODE, [40, 44, 48, 52], [1] * 4), group_size=2, shared_len=36)
    sinks = _sinks(1)
    backend = TorchNativeAttention(min_shared_prefix=1)
    out = run_backend(backend, case, None, sinks)
    assert case.batch.attn_metadata.shared, "the batch should have run as cascade attention"
    torch.testing.assert_close(out.double(), reference_attention(case, sinks=sinks), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel(cpu_kernels, mode, prefix_lens, extend_lens, window, dtype):
    case = _case(mode, prefix_lens, extend_lens, dtype=dtype)
    sinks = _sinks()
    expected = reference_attention(case, sliding_window=window, sinks=sinks)
    out = run_backend(CpuAttentionBackend(max_extend_len=None), case, window, sinks)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_cpu_kernel_shared_prefixes(cpu_kernels):
    case = share_prefixes(_case(ForwardMode.DECODE, [40, 44, 48, 52], [1] * 4), group_size=2, shared_len=36)
    sinks = _sinks(2)
    backend = CpuAttentionBackend(min_shared_prefix=1, max_extend_len=None)
    out = run_backend(backend, case, None, sinks)
    assert case.batch.attn_metadata.num_groups_shared > 0
    torch.testing.assert_close(out.double(), reference_attention(case, sinks=sinks), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", CASES)
def test_triton(mode, prefix_lens, extend_lens, window):
    """The sink joins the extend kernel's online softmax and the decode kernel's merge of its splits."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs here only under its interpreter (tests/conftest.py sets TRITON_INTERPRET=1)")
    from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _case(mode, prefix_lens, extend_lens, device=device)
    sinks = _sinks().to(device)
    expected = reference_attention(case, sliding_window=window, sinks=sinks)
    backend = TritonAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, device, max_batch_size=8, max_kv_splits=4)
    out = run_backend(backend, case, window, sinks)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


# ---- FlashInfer (GPU only) -----------------------------------------------------------------------

needs_flashinfer = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs a CUDA device")
GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM = 16, 2, 64  # gpt-oss's GQA of 8 and head_dim
BF16_ATOL = 2e-2


def _flashinfer(page_size: int, windows=(), prefill_backend: str = "auto"):
    pytest.importorskip("flashinfer")
    from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(GPU_HEADS, GPU_KV_HEADS, GPU_HEAD_DIM, torch.bfloat16, "cuda",
                                      page_size=page_size, sliding_windows=windows, prefill_backend=prefill_backend)


def _gpu_sinks() -> torch.Tensor:
    return (torch.randn(GPU_HEADS, generator=torch.Generator().manual_seed(3)) * 2.0 + 1.0).float().cuda()


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer(mode, prefix_lens, extend_lens, window, page_size):
    case = make_case(mode, prefix_lens, extend_lens, num_heads=GPU_HEADS, num_kv_heads=GPU_KV_HEADS,
                     head_dim=GPU_HEAD_DIM, page_size=page_size, dtype=torch.bfloat16, device="cuda", seed=page_size)
    sinks = _gpu_sinks()
    expected = reference_attention(case, device="cuda", sliding_window=window, sinks=sinks)
    out = run_backend(_flashinfer(page_size, () if window is None else (window,)), case, window, sinks)
    error = (out.double() - expected).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


@needs_flashinfer
@pytest.mark.gpu
def test_flashinfer_cascade_carries_the_merged_log_sum_exp():
    from radixserve.model_runner.attention.flashinfer_cascade import CascadeMetadata
    from radixserve.model_runner.forward_batch import PrefixGroups

    case = make_case(ForwardMode.DECODE, [300, 310, 320, 330], [1] * 4, num_heads=GPU_HEADS,
                     num_kv_heads=GPU_KV_HEADS, head_dim=GPU_HEAD_DIM, page_size=1, dtype=torch.bfloat16,
                     device="cuda", seed=9)
    case = share_prefixes(case, group_size=2, shared_len=256)
    case.batch.prefix_groups = PrefixGroups(members=[[0, 1], [2, 3]], lengths=[256, 256])
    backend = _flashinfer(1)
    backend.cascade_min_saved_bytes = 0
    backend.warm_up(torch.bfloat16)
    sinks = _gpu_sinks()
    out = run_backend(backend, case, None, sinks)
    assert isinstance(case.batch.attn_metadata, CascadeMetadata)
    error = (out.double() - reference_attention(case, device="cuda", sinks=sinks)).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"


@needs_flashinfer
@pytest.mark.gpu
def test_flashinfer_fa3_prefill():
    """Hopper's FA3 prefill kernels return their log-sum-exp in the same base as FA2's."""
    from radixserve.kernels.flashinfer_wrappers import fa3_available

    if not fa3_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("FlashInfer's FA3 kernels need a Hopper GPU")
    case = make_case(ForwardMode.EXTEND, [0, 37, 300], [300, 129, 200], num_heads=GPU_HEADS,
                     num_kv_heads=GPU_KV_HEADS, head_dim=GPU_HEAD_DIM, page_size=16, dtype=torch.bfloat16,
                     device="cuda", seed=4)
    sinks = _gpu_sinks()
    out = run_backend(_flashinfer(16, prefill_backend="fa3"), case, None, sinks)
    error = (out.double() - reference_attention(case, device="cuda", sinks=sinks)).abs().max().item()
    assert error < BF16_ATOL, f"max abs error vs float64 reference: {error}"
