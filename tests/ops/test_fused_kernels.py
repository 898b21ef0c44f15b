"""The fused Triton kernels (RMSNorm with residual add, SiLU-and-mul, rotary embedding, KV store) against the
torch reference implementations in `model_runner/layers.py` (the ones the CPU models run, which the model
tests hold bit-exact to `transformers`) and against plain indexed writes.

Without a GPU the kernels run under the Triton interpreter; `TRITON_INTERPRET=1` has to be in the
environment before the process first imports triton: tests/conftest.py sets it on machines without a GPU.
On a GPU the kernels are compiled and also compared in bfloat16, and one test replays them
inside a CUDA graph.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from radixserve.kernels import fused_activation, fused_norm, fused_rotary, kv_store  # noqa: E402
from radixserve.model_runner.layers import TORCH_OPS, RMSNorm, RotaryEmbedding, fused_ops, ops_for  # noqa: E402

RUNS_HERE = ON_GPU or all(
    isinstance(fn, InterpretedFunction)
    for fn in (tl.zeros, fused_norm._rms_norm_kernel, fused_activation._silu_and_mul_kernel,
               fused_rotary._rotary_kernel, kv_store._store_kv_kernel)
)
DEVICE = "cuda" if ON_GPU else "cpu"
# tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU before anything imports triton.
assert RUNS_HERE, "triton was imported before TRITON_INTERPRET=1 was set: the kernels would not run"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Normalization differs from the reference only in float32 summation order and the rsqrt intrinsic, which
# can move a rounded result by one unit in the last place of the activation dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


# ---- RMSNorm -------------------------------------------------------------------------------------

# (rows, cols, max_single_pass): odd widths, one row and several, and rows longer than one pass's block
# (the two-pass path, including a width that is not a multiple of the block).
NORM_SHAPES = [(1, 4096, fused_norm.MAX_SINGLE_PASS), (3, 37, fused_norm.MAX_SINGLE_PASS),
               (5, 1000, fused_norm.MAX_SINGLE_PASS), (4, 300, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,max_single_pass", NORM_SHAPES)
def test_rms_norm_matches_torch(dtype, rows, cols, max_single_pass):
    x = _randn(rows, cols, dtype=dtype, seed=1) * 3
    weight = (1 + 0.1 * _randn(cols, dtype=torch.float32, seed=2)).to(dtype)
    x_before = x.clone()
    out = fused_norm.rms_norm(x, weight, 1e-5, max_single_pass=max_single_pass)
    _assert_close(out, TORCH_OPS.rms_norm(x, weight, 1e-5), dtype)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,max_single_pass", NORM_SHAPES)
def test_add_rms_norm_matches_torch(dtype, rows, cols, max_single_pass):
    x = _randn(rows, cols, dtype=dtype, seed=3)
    residual = _randn(rows, cols, dtype=dtype, seed=4) * 4
    weight = (1 + 0.1 * _randn(cols, dtype=torch.float32, seed=5)).to(dtype)
    inputs_before = (x.clone(), residual.clone())
    out, summed = fused_norm.fused_add_rms_norm(x, residual, weight, 1e-6, max_single_pass=max_single_pass)
    expected_out, expected_summed = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-6)
    # One rounding of an exact sum, in both: the residual stream is identical, not just close.
    assert torch.equal(summed, expected_summed)
    _assert_close(out, expected_out, dtype)
    assert torch.equal(x, inputs_before[0]) and torch.equal(residual, inputs_before[1])


def test_rms_norm_strided_rows_and_weight_promotion():
    """Rows read through a strided view (a slice of a wider buffer, and per-head rows of a 3-D tensor);
    a float32 weight over float16 activations gives float32 output, as the torch reference does."""
    wide = _randn(6, 100, dtype=torch.float16, seed=6)
    x = wide[:, 10:74]  # row stride 100, width 64
    weight = 1 + 0.1 * _randn(64, dtype=torch.float32, seed=7)
    out = fused_norm.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    _assert_close(out, TORCH_OPS.rms_norm(x, weight, 1e-6), torch.float32)

    heads = _randn(3, 4, 64, dtype=torch.float32, seed=8)[:, 1:3]  # [T, H, D], not flattenable as a view
    weight32 = 1 + 0.1 * _randn(64, dtype=torch.float32, seed=9)
    _assert_close(fused_norm.rms_norm(heads, weight32, 1e-6), TORCH_OPS.rms_norm(heads, weight32, 1e-6),
                  torch.float32)


# ---- SiLU-and-mul --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 14), (3, 2 * 1100), (2, 3, 2 * 50)])
def test_silu_and_mul_matches_torch(dtype, shape):
    """Intermediate widths below one block, across a block boundary (1100 > 1024), and extra leading dims."""
    gate_up = _randn(*shape, dtype=dtype, seed=10) * 3
    _assert_close(fused_activation.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), dtype)


def test_silu_and_mul_strided_rows():
    wide = _randn(4, 90, dtype=torch.float32, seed=11)
    gate_up = wide[:, 5:85]  # row stride 90, intermediate 40
    _assert_close(fused_activation.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), torch.float32)


# ---- rotary embedding -----------------------------------------------------------------------------

def _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """q, k, v as the models produce them: strided views of one fused qkv projection output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (qkv, q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def _assert_rotary_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # Every product and sum is rounded to the activation dtype exactly where the reference rounds it, and
    # none is fused into a multiply-add, so the results are identical in every dtype.
    assert actual.dtype == expected.dtype == dtype
    assert torch.equal(actual, expected), f"max difference {(actual.float() - expected.float()).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 40), (4, 4, 16), (5, 1, 64)])
def test_rotary_matches_torch(dtype, position_dtype, num_heads, num_kv_heads, head_dim):
    """GQA and MHA, head counts that are not powers of two, head_dim 40 (half not a power of two); q and k
    read through strided views of a fused qkv; results to new contiguous tensors, inputs untouched."""
    rotary = RotaryEmbedding(head_dim, max_positions=300, base=10000.0)
    cos, sin = rotary.cos.to(DEVICE), rotary.sin.to(DEVICE)
    num_tokens = 7
    qkv, q, k, _ = _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=12)
    qkv_before = qkv.clone()
    positions = torch.tensor([0, 1, 299, 17, 17, 128, 5], dtype=position_dtype, device=DEVICE)
    q_rot, k_rot = fused_rotary.apply_rotary(positions, q, k, cos, sin)
    expected_q, expected_k = TORCH_OPS.rotary(positions.long(), q, k, cos, sin)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    _assert_rotary_close(q_rot, expected_q, dtype)
    _assert_rotary_close(k_rot, expected_k, dtype)
    assert torch.equal(qkv, qkv_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place(dtype):
    """With `out_q=q, out_k=k` the rotation lands in the fused qkv buffer itself and v is left alone."""
    rotary = RotaryEmbedding(32, max_positions=64, base=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    cos, sin = rotary.cos.to(DEVICE), rotary.sin.to(DEVICE)
    qkv, q, k, v = _qkv_views(5, 4, 2, 32, dtype, seed=13)
    v_before = v.clone()
    positions = torch.tensor([3, 63, 0, 40, 9], device=DEVICE)
    expected_q, expected_k = TORCH_OPS.rotary(positions, q, k, cos, sin)
    out_q, out_k = fused_rotary.apply_rotary(positions, q, k, cos, sin, out_q=q, out_k=k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    _assert_rotary_close(q, expected_q, dtype)
    _assert_rotary_close(k, expected_k, dtype)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 40), (4, 4, 16), (5, 1, 64)])
def test_rotary_with_head_norms_matches_norms_then_rotary(dtype, num_heads, num_kv_heads, head_dim):
    """Qwen3's per-head q and k norms in the rotation's launch: against the torch reference (each norm, then the
    rotation) and against the two Triton kernels run one after the other, on strided views of a fused qkv. The
    norm's sum of squares runs in another order than the row kernel's, which may move a rounded value by one unit in
    the last place, and the rotation then carries that unit."""
    rotary = RotaryEmbedding(head_dim, max_positions=300, base=10000.0)
    cos, sin = rotary.cos.to(DEVICE), rotary.sin.to(DEVICE)
    _, q, k, _ = _qkv_views(7, num_heads, num_kv_heads, head_dim, dtype, seed=14)
    q, k = q * 3, k * 3
    q_weight, k_weight = _randn(head_dim, dtype=dtype, seed=15), _randn(head_dim, dtype=dtype, seed=16)
    positions = torch.tensor([0, 1, 299, 17, 17, 128, 5], device=DEVICE)
    eps = 1e-6
    q_out, k_out = fused_ops().head_norm_rotary(positions, q, k, cos, sin, q_weight, k_weight, eps)
    assert q_out.dtype == k_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    expected_q, expected_k = TORCH_OPS.head_norm_rotary(positions, q, k, cos, sin, q_weight, k_weight, eps)
    _assert_close(q_out, expected_q, dtype)
    _assert_close(k_out, expected_k, dtype)
    two_q, two_k = fused_rotary.apply_rotary(positions, fused_norm.rms_norm(q, q_weight, eps),
                                             fused_norm.rms_norm(k, k_weight, eps), cos, sin)
    _assert_close(q_out, two_q, dtype)
    _assert_close(k_out, two_k, dtype)
    if dtype == torch.float32:  # nothing to round between the steps: equal up to the sums' order
        torch.testing.assert_close(q_out, two_q, rtol=1e-6, atol=1e-6)


def test_rotary_with_head_norms_of_other_eps_runs_each_norm():
    """Norms of different eps (or weights of another dtype than q) take each norm's own call, then the rotation."""
    rotary = RotaryEmbedding(16, max_positions=32, base=10000.0)
    _, q, k, _ = _qkv_views(3, 4, 2, 16, torch.float32, seed=17)
    q_norm, k_norm = RMSNorm(16, eps=1e-6).to(DEVICE), RMSNorm(16, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        q_norm.weight.copy_(_randn(16, dtype=torch.float32, seed=18))
        k_norm.weight.copy_(_randn(16, dtype=torch.float32, seed=19))
    positions = torch.tensor([2, 30, 7], device=DEVICE)
    q_out, k_out = rotary.with_head_norms(positions, q, k, q_norm, k_norm)
    expected_q, expected_k = rotary(positions, q_norm(q), k_norm(k))
    assert torch.equal(q_out, expected_q) and torch.equal(k_out, expected_k)


# ---- KV store ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype,buffer_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                   (torch.float32, torch.float16)])
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_indexed_writes(kv_dtype, buffer_dtype, loc_dtype):
    """K and V read from strided views of a fused qkv, written at scattered slots, cast to the buffer
    dtype; every other slot keeps its old contents."""
    num_slots, num_kv_heads, head_dim = 50, 3, 24
    _, _, k, v = _qkv_views(6, 6, num_kv_heads, head_dim, kv_dtype, seed=14)
    loc = torch.tensor([7, 0, 49, 12, 3, 30], dtype=loc_dtype, device=DEVICE)
    k_buffer = _randn(num_slots, num_kv_heads, head_dim, dtype=buffer_dtype, seed=15)
    v_buffer = _randn(num_slots, num_kv_heads, head_dim, dtype=buffer_dtype, seed=16)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    expected_k[loc.long()] = k.to(buffer_dtype)
    expected_v[loc.long()] = v.to(buffer_dtype)
    kv_store.store_kv(k_buffer, v_buffer, loc, k, v)
    assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)


# ---- dispatch ------------------------------------------------------------------------------------

def test_cpu_tensors_take_the_torch_reference_or_the_cpu_kernels():
    """The CPU takes the reference path until the C++ kernels are loaded (tests/ops/test_cpu_elementwise.py), and
    always for dtypes those do not cover."""
    from radixserve.kernels import cpu_build
    from radixserve.model_runner.layers import cpu_kernel_ops

    assert ops_for(torch.zeros(1)) is (cpu_kernel_ops() if cpu_build.ready() else TORCH_OPS)
    assert ops_for(torch.zeros(1, dtype=torch.float64)) is TORCH_OPS
    if ON_GPU:
        assert ops_for(torch.zeros(1, device="cuda")) is fused_ops()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_ops_replay_in_a_cuda_graph():
    """A captured sequence of every fused op, replayed after its static inputs change, gives what the
    kernels give eagerly on the new inputs (no host syncs, no shapes that depend on values)."""
    dtype, hidden, heads, kv_heads, head_dim, inter = torch.bfloat16, 256, 4, 2, 64, 384
    ops = fused_ops()
    rotary = RotaryEmbedding(head_dim, max_positions=128, base=10000.0)
    cos, sin = rotary.cos.cuda(), rotary.sin.cuda()
    weight = torch.ones(hidden, dtype=dtype, device="cuda")
    x = torch.randn(4, hidden, dtype=dtype, device="cuda")
    residual = torch.randn(4, hidden, dtype=dtype, device="cuda")
    gate_up = torch.randn(4, 2 * inter, dtype=dtype, device="cuda")
    _, q, k, v = _qkv_views(4, heads, kv_heads, head_dim, dtype, seed=17)
    positions = torch.tensor([1, 2, 3, 4], device="cuda")
    loc = torch.tensor([1, 2, 3, 4], device="cuda")
    k_buffer = torch.zeros(8, kv_heads, head_dim, dtype=dtype, device="cuda")
    v_buffer = torch.zeros_like(k_buffer)

    def step():
        normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
        q_rot, k_rot = ops.rotary(positions, q, k, cos, sin)
        kv_store.store_kv(k_buffer, v_buffer, loc, k_rot, v)
        return normed, summed, ops.silu_and_mul(gate_up), q_rot

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for tensor in (x, residual, gate_up, q, k, v):
        tensor.copy_(torch.randn_like(tensor))
    positions.copy_(torch.tensor([100, 7, 0, 127]))
    graph.replay()
    k_after_replay = k_buffer.clone()
    eager = step()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
    assert torch.equal(k_after_replay, k_buffer)
