"""Sliding-window attention in every CPU-testable backend against a float64 reference with the window's mask.

A layer with window W attends from position t to the keys t - W < p <= t only. Each case also points the positions
that no query of a request sees at a slot full of NaN (attention_cases.poison_outside_windows), as a window-aware
pool may hand such slots to other requests: a backend that reads one fails. torch_native and the C++ CPU kernel run
here; Triton under its interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 first); FlashInfer on a GPU
only (benchmarks/sliding_window_gpu.py).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from attention_cases import (kv_written, make_case, poison_outside_windows, reference_attention, run_backend,
                             with_window_slots)
from radixserve.kernels import cpu_build
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan
from radixserve.model_runner.attention.torch_native import TorchNativeAttention
from radixserve.model_runner.attention.torch_native_plan import TorchNativeMetadata
from radixserve.model_runner.forward_batch import ForwardMode

# (mode, prefix_lens, extend_lens, window): windows shorter than the prefixes, than the extends, and longer than
# some sequences; a window of one position.
CASES = [
    (ForwardMode.DECODE, [0, 5, 31, 40, 200], [1] * 5, 16),
    (ForwardMode.DECODE, [3, 70], [1, 1], 1),
    (ForwardMode.EXTEND, [0, 0], [37, 9], 8),
    (ForwardMode.EXTEND, [40, 0, 3], [70, 5, 33], 24),
    (ForwardMode.EXTEND, [50], [20], 64),
    (ForwardMode.MIXED, [10, 64, 0], [1, 20, 1], 12),
]
SHAPES = [(4, 2, 16), (6, 2, 32)]


def _case(mode, prefix_lens, extend_lens, window, shape, page_size=1, dtype=torch.float32):
    num_heads, num_kv_heads, head_dim = shape
    case = make_case(mode, prefix_lens, extend_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, dtype=dtype, seed=sum(prefix_lens) + window)
    expected = reference_attention(case, sliding_window=window)
    poison_outside_windows(case, window)
    return case, expected


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_pairs", [None, 0, math.inf])  # default chunks, request by request, one padded call
def test_torch_native(mode, prefix_lens, extend_lens, window, shape, chunk_pairs):
    case, expected = _case(mode, prefix_lens, extend_lens, window, shape)
    backend = TorchNativeAttention(max_chunk_pairs=chunk_pairs, max_padding_waste=math.inf if chunk_pairs else None)
    out = run_backend(backend, case, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_torch_native_full_layers_unchanged_beside_windowed_ones():
    """One batch, a windowed layer then a full one: each gets its own mask, the full one every key."""
    case = make_case(ForwardMode.EXTEND, [30, 4], [10, 20], num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32)
    backend = TorchNativeAttention(min_shared_prefix=math.inf)
    windowed = run_backend(backend, case, 6)
    torch.testing.assert_close(windowed.double(), reference_attention(case, sliding_window=6), atol=2e-5, rtol=2e-5)
    full = backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch)
    torch.testing.assert_close(full.double(), reference_attention(case), atol=2e-5, rtol=2e-5)
    assert set(case.batch.attn_metadata.windowed) == {6}


def test_window_longer_than_every_sequence_runs_the_full_plan():
    case = make_case(ForwardMode.DECODE, [5, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32)
    backend = TorchNativeAttention()
    out = run_backend(backend, case, 64)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)
    assert not case.batch.attn_metadata.windowed


@pytest.fixture(scope="module")
def cpu_kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built")
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel(cpu_kernels, mode, prefix_lens, extend_lens, window, shape, dtype):
    case, expected = _case(mode, prefix_lens, extend_lens, window, shape, dtype=dtype)
    backend = CpuAttentionBackend(max_extend_len=None)
    out = run_backend(backend, case, window)
    plan = case.batch.attn_metadata
    assert isinstance(plan, CpuAttentionPlan)
    if max(case.batch.seq_lens_cpu) > window:  # decode batches through the kernel, extends through torch_native
        kind = CpuAttentionPlan if max(extend_lens) == 1 else TorchNativeMetadata
        assert isinstance(plan.windowed[window], kind)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


# The window layer's KV in a slot space of its own (radix_cache/swa_pool.py): read and written through the window map.
WINDOW_SLOT_CASES = [case for case in CASES if case[3] > 1] + [(ForwardMode.DECODE, [3, 5], [1, 1], 64)]


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", WINDOW_SLOT_CASES)
def test_torch_native_reads_and_writes_window_slots(mode, prefix_lens, extend_lens, window):
    case = make_case(mode, prefix_lens, extend_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32, seed=window)
    expected = reference_attention(case, sliding_window=window)
    with_window_slots(case, window, seed=len(prefix_lens))
    out = run_backend(TorchNativeAttention(), case, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert kv_written(case)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", WINDOW_SLOT_CASES)
def test_cpu_kernel_reads_and_writes_window_slots(cpu_kernels, mode, prefix_lens, extend_lens, window):
    case = make_case(mode, prefix_lens, extend_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32, seed=window)
    expected = reference_attention(case, sliding_window=window)
    with_window_slots(case, window, seed=len(prefix_lens))
    out = run_backend(CpuAttentionBackend(max_extend_len=None), case, window)
    if max(extend_lens) == 1:  # decode batches through the kernel, with the window slots
        assert isinstance(case.batch.attn_metadata.windowed[window], CpuAttentionPlan)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert kv_written(case)


def test_full_layer_beside_window_slots_reads_the_full_slots():
    """A batch on a pool with window slots: the full layer reads and writes the full buffers at the full slots."""
    case = make_case(ForwardMode.EXTEND, [30, 4], [10, 20], num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32, layer_id=1)
    with_window_slots(case, 6)
    backend = TorchNativeAttention(min_shared_prefix=math.inf)
    backend.plan(case.batch)
    full_layer = 0  # with_window_slots gives a window slot space to layer 1 only
    pool = case.batch.token_to_kv_pool
    assert not pool.is_window_layer(full_layer) and pool.is_window_layer(1)
    for i, (prefix_k, prefix_v) in enumerate(zip(case.prefix_k, case.prefix_v)):  # layer 0's own prefix K/V
        row = int(case.batch.req_pool_indices[i])
        slots = case.batch.req_to_token_pool.req_to_token[row, :case.batch.prefix_lens_cpu[i]].long()
        case.prefix_k[i] = pool.k_buffer[full_layer][slots].double()
        case.prefix_v[i] = pool.v_buffer[full_layer][slots].double()
    out = backend.forward(case.q, case.k, case.v, full_layer, case.scaling, case.batch)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)
    assert torch.equal(pool.k_buffer[full_layer][case.batch.out_cache_loc], case.k)
