"""The quantized GEMMs against float64 references of their dequantized operands: the Triton W4A16 GEMMs
(kernels/w4a16_gemm.py: the skinny decode kernels on FMAs and on the tensor cores, and the tiled one), the skinny FP8
GEMMs (kernels/fp8_skinny_gemm.py), the Triton block-scaled FP8 GEMM (kernels/fp8_block_gemm.py), and the FP8 products
of model_runner/quantization/fp8.py (`torch._scaled_mm` on CUDA, the float reference elsewhere).

Without a GPU the Triton kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set before anything imports
triton) at small shapes; on a GPU they are compiled and also checked in bfloat16 at Llama-3.1-8B's projection shapes
and inside a CUDA graph.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import radixserve.kernels.fp8_skinny_gemm as fp8_skinny_module  # noqa: E402
import radixserve.kernels.w4a16_gemm as w4a16_module  # noqa: E402
from radixserve.kernels.fp8_block_gemm import fp8_block_gemm  # noqa: E402
from radixserve.kernels.fp8_skinny_gemm import MAX_ROWS, fp8_skinny_config, w8a16_gemm, w16a16_gemm  # noqa: E402
from radixserve.kernels.w4a16_gemm import (SKINNY_MAX_ROWS as W4A16_SKINNY_MAX_ROWS, SkinnyConfig,  # noqa: E402
                                           W4A16Config, skinny_config, w4a16_dequantize, w4a16_gemm)
from radixserve.model_runner.quantization.fp8 import (FP8_DTYPE, SKINNY_MAX_ROWS, ActivationScheme,  # noqa: E402
                                                      Fp8Weight, fp8_linear, quantize_per_row)
from radixserve.model_runner.quantization.int4 import Int4Weight, pack_rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# Llama-3.1-8B's projections (N, K): qkv, o, gate/up, down.
LLAMA_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def random_int4(n: int, k: int, group_size: int, act_order: bool, dtype: torch.dtype, seed: int = 0) -> Int4Weight:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=generator)
    groups = -(-k // group_size)  # a last, shorter group where K is not a multiple of it
    scales = (torch.rand(groups, n, generator=generator) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=generator).to(dtype)
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=generator)] = (torch.arange(k) // group_size).to(torch.int32)
    weight = Int4Weight(pack_rows(q), scales, zeros, group_size, g_idx)
    return Int4Weight(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in
                        (weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.g_idx)))


def reference_int4(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """float64 product with the dequantized weight, computed here from the unpacked nibbles."""
    k = x.shape[1]
    shifts = 4 * (torch.arange(k, device=x.device) % 8)
    q = (weight.qweight.long()[torch.arange(k, device=x.device) // 8] >> shifts[:, None]) & 0xF  # [K, N]
    groups = weight.g_idx.long() if weight.g_idx is not None else torch.arange(k, device=x.device) // weight.group_size
    w = (q.double() - weight.zeros.double()[groups]) * weight.scales.double()[groups]
    return x.double() @ w


def assert_close(out: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    error = (out.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= rel * scale, f"max error {error:.3g} against max |value| {scale:.3g}"


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [64, 128])
def test_w4a16_gemm_matches_float64(m, act_order, group_size):
    n, k = 96, 256
    dtype = torch.float16 if ON_GPU else torch.float32
    weight = random_int4(n, k, group_size, act_order, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, group_size, weight.g_idx)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, reference_int4(x, weight), 1e-5 if dtype == torch.float32 else 2e-3)


def test_w4a16_gemm_split_k_adds_partial_sums():
    n, k, m = 64, 512, 20
    weight = random_int4(n, k, 128, False, torch.float32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    config = W4A16Config(block_m=16, block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=2)
    out = w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 128, None, config)
    assert_close(out, reference_int4(x, weight), 1e-5)


# (N, K, group size, act-order): N not a multiple of the column block; K not a multiple of the K tile (act-order
# only: without g_idx a K tile lies in one group, so K is whole tiles) and groups of 32, 64 and 128.
SKINNY_W4A16_SHAPES = [(100, 320, 64, False), (72, 256, 32, False), (96, 256, 128, True), (70, 200, 128, True)]


# (rows, tensor cores): an FMA program takes one row, so 16 rows on FMAs (slow under the interpreter) run at one shape.
SKINNY_ROWS = [(1, False), (3, False), (1, True), (3, True), (16, True)]


@pytest.mark.parametrize("m, use_dot, n, k, group_size, act_order",
                         [rows + shape for shape in SKINNY_W4A16_SHAPES for rows in SKINNY_ROWS]
                         + [(16, False) + SKINNY_W4A16_SHAPES[0], (16, False) + SKINNY_W4A16_SHAPES[2]])
def test_w4a16_skinny_kernels_match_float64(m, use_dot, n, k, group_size, act_order):
    """Both skinny W4A16 kernels (FMAs, one row a program; tensor cores, 16 rows a program) against the float64
    product, K split unevenly (3 splits of a K not divisible by them) so that the partial sums are added."""
    weight = random_int4(n, k, group_size, act_order, torch.float32, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    # A tensor-core tile lies in one group; an FMA tile of 64 features spans two groups of 32.
    config = SkinnyConfig(block_n=32, block_k=32 if group_size == 32 and use_dot else 64, split_k=3, use_dot=use_dot,
                          num_warps=4, num_stages=2)
    out = w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, group_size, weight.g_idx, config)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_close(out, reference_int4(x, weight), 1e-5)


def test_w4a16_fma_kernel_takes_groups_that_are_not_a_power_of_two():
    """One group over all 200 input features (a per-channel checkpoint): the FMA kernel's 128-feature tiles span it."""
    weight = random_int4(48, 200, 200, False, torch.float32, seed=5)
    x = torch.randn(1, 200, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 200, None)
    assert_close(out, reference_int4(x, weight), 1e-5)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_skinny_default_configs_match_float64(m, act_order):
    """The configs a call picks by itself (one split or several, FMAs at one row, tensor cores above), with zero
    points off the integers (the per-tile zero-point correction assumes nothing of them)."""
    n, k = 96, 1024
    weight = random_int4(n, k, 128, act_order, torch.float32, seed=m)
    weight.zeros += 0.5
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    out = w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 128, weight.g_idx)
    assert_close(out, reference_int4(x, weight), 1e-5)


def test_skinny_configs_split_k_to_fill_the_gpu_at_llama_8b_shapes(monkeypatch):
    """The defaults (no measured rows): at one row each SM gets about four programs (column blocks times splits),
    each split keeping at least two K tiles; the column-rich gate/up projection splits least. FMAs at one row, tensor
    cores from two rows."""
    monkeypatch.setattr(w4a16_module, "TUNED_SKINNY", {})
    monkeypatch.setattr(fp8_skinny_module, "TUNED", {})
    for n, k in LLAMA_8B_SHAPES:
        for m in (1, 2, 16):
            w4 = skinny_config(m, n, k, 128, False, num_sms=132)
            fp8 = fp8_skinny_config(m, n, k, None, num_sms=132)
            for config in (w4, fp8):
                assert config.use_dot == (m > 1)
                programs = -(-n // config.block_n) * (1 if config.use_dot else m) * config.split_k
                assert programs >= 4 * 132 or config.split_k == 16 or -(-k // config.block_k) < 4 * config.split_k
                assert -(-k // config.block_k) >= 2 * config.split_k
    gate_up, o = (skinny_config(1, n, 4096, 128, False, num_sms=132).split_k for n in (28672, 4096))
    assert gate_up < o
    assert W4A16_SKINNY_MAX_ROWS == 16


def test_measured_fp8_rows_cover_their_row_counts_only(monkeypatch):
    """A shape in the FP8 kernel's `TUNED` takes the first row whose max_rows covers M; beyond the last row, and for
    block scales, the defaults (the rows measured at one row leave the tensor-core configs of more rows alone)."""
    rows = [(1, SkinnyConfig(64, 256, 4, False, 8, 3)), (4, SkinnyConfig(64, 128, 2, True, 4, 4))]
    monkeypatch.setattr(fp8_skinny_module, "TUNED", {(6144, 4096, None): rows})
    picks = [fp8_skinny_config(m, 6144, 4096, None, num_sms=132) for m in (1, 3, 4)]
    assert picks == [rows[0][1], rows[1][1], rows[1][1]]
    beyond, blocks = fp8_skinny_config(5, 6144, 4096, None, 132), fp8_skinny_config(1, 6144, 4096, (128, 128), 132)
    monkeypatch.setattr(fp8_skinny_module, "TUNED", {})
    assert beyond == fp8_skinny_config(5, 6144, 4096, None, 132)
    assert blocks == fp8_skinny_config(1, 6144, 4096, (128, 128), 132)
    assert fp8_skinny_config(1, 6144, 4096, None, 132) != rows[0][1]


def test_measured_skinny_rows_are_taken_by_row_count(monkeypatch):
    """A shape in `TUNED_SKINNY` takes the first row whose max_rows covers M, the last beyond them; another group
    size and act-order weights keep the defaults."""
    rows = w4a16_module.TUNED_SKINNY[(4096, 4096, 128)]
    picks = [skinny_config(m, 4096, 4096, 128, False, num_sms=132) for m in (1, 3, 16, 40)]
    assert picks == [rows[0][1], rows[1][1], rows[2][1], rows[-1][1]]
    untuned = [skinny_config(1, 4096, 4096, 64, False, 132), skinny_config(1, 4096, 4096, 128, True, 132)]
    monkeypatch.setattr(w4a16_module, "TUNED_SKINNY", {})
    assert untuned == [skinny_config(1, 4096, 4096, 64, False, 132), skinny_config(1, 4096, 4096, 128, True, 132)]
    assert skinny_config(1, 4096, 4096, 128, False, 132) != rows[0][1]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_dequantize_writes_the_weight_the_gemms_read(act_order, dtype):
    """`w4a16_dequantize` (the large-row path's weight) against the float64 dequantization, within one rounding to
    `dtype` (one ulp: the Triton interpreter's float32 to bfloat16 conversion truncates where the GPU's rounds)."""
    n, k = 160, 384
    weight = random_int4(n, k, 64, act_order, dtype)
    eye = torch.eye(k, device=DEVICE, dtype=torch.float64)
    expected = reference_int4(eye, weight)  # [K, N]: W.T in float64
    out = w4a16_dequantize(weight.qweight, weight.scales, weight.zeros, 64, weight.g_idx, dtype)
    assert out.shape == (k, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=2**-23 if dtype == torch.float32 else 2**-7, atol=0)


def test_w4a16_gemm_multiplies_the_dequantized_weight_from_its_row_threshold(monkeypatch):
    """16-bit calls from `DEQUANTIZE_FROM_ROWS` rows take the dequantized weight (the product equals `x @ W.T` on
    the weight `w4a16_dequantize` writes); fewer rows and float32 calls keep the Triton kernels."""
    n, k, dtype = 64, 256, torch.bfloat16
    weight = random_int4(n, k, 128, False, dtype)
    monkeypatch.setattr(w4a16_module, "DEQUANTIZE_FROM_ROWS", 4)
    x = torch.randn(5, k, device=DEVICE).to(dtype)
    dense = w4a16_dequantize(weight.qweight, weight.scales, weight.zeros, 128, None, dtype)
    torch.testing.assert_close(w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 128), x @ dense,
                               rtol=0, atol=0)
    assert_close(w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 128), reference_int4(x, weight), 2e-2)
    calls = []
    monkeypatch.setattr(w4a16_module, "w4a16_dequantize", lambda *args: calls.append(args))
    w4a16_gemm(x[:3], weight.qweight, weight.scales, weight.zeros, 128)
    w4a16_gemm(x.float(), weight.qweight, weight.scales.float(), weight.zeros.float(), 128)
    assert calls == []


def test_int4_layout_dequantizes_and_narrows_as_the_kernel_reads_it():
    weight = random_int4(64, 256, 64, False, torch.float32)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert_close(x.double() @ weight.dequantize().double().T, reference_int4(x, weight), 1e-6)
    rows = weight.narrow(0, 16, 32)  # output features 16..47: a column-parallel shard
    assert_close(x.double() @ rows.dequantize().double().T, reference_int4(x, weight)[:, 16:48], 1e-6)
    cols = weight.narrow(1, 128, 128)  # input features 128..255: a row-parallel shard
    assert_close(x[:, 128:].double() @ cols.dequantize().double().T,
                 x[:, 128:].double() @ weight.dequantize().double()[:, 128:].T, 1e-6)
    with pytest.raises(ValueError, match="group boundary"):
        weight.narrow(1, 32, 64)


def random_fp8_block_operands(m: int, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * (1 + 4 * torch.rand(m, 1, generator=generator))
    w = torch.randn(n, k, generator=generator) * 0.05
    x_q, x_scale = quantize_per_row(x, 128)
    weight = Fp8Weight.quantize(w, (128, 128))
    return x_q, x_scale, weight


@pytest.mark.parametrize("m, n, k", [(1, 256, 256), (7, 384, 320), (40, 200, 384)])
def test_fp8_block_gemm_matches_float64(m, n, k):
    x_q, x_scale, weight = random_fp8_block_operands(m, n, k)
    expected = (x_q.double() * x_scale.double().repeat_interleave(128, 1)[:, :k]) @ weight.dequantize().double().T
    out = fp8_block_gemm(x_q.to(DEVICE), x_scale.to(DEVICE), weight.weight.to(DEVICE), weight.scale.to(DEVICE),
                         (128, 128), torch.float32)
    # Hopper's FP8 tensor-core products accumulate with fewer bits than float32 within each 128-wide K block (the
    # kernel adds the blocks in float32): about 2e-4 of the largest value on an H100; exact under the interpreter.
    assert_close(out, expected.to(DEVICE), 1e-3 if ON_GPU else 1e-5)


def test_split_k_sums_in_one_launch_the_same_every_time_and_leaves_its_counters_at_zero():
    """The last split of a tile adds the partial sums in split order, so repeated calls give the same bits (on a GPU,
    200 calls at Llama-3.1-8B's o_proj shape, where a split reading another's slice before it is written would show),
    and each call hands the shared counters back at zero for the next."""
    from radixserve.kernels.split_k import split_counters

    n, k, repeats = (4096, 4096, 200) if ON_GPU else (96, 512, 3)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    int4 = random_int4(n, k, 128, False, dtype)
    fp8 = Fp8Weight.quantize(torch.randn(n, k) * 0.05, (128, 128))
    fp8 = Fp8Weight(fp8.weight.to(DEVICE), fp8.scale.to(DEVICE), fp8.block)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    calls = []
    for use_dot in (False, True):
        int4_config = SkinnyConfig(64, 128, 8 if ON_GPU else 3, use_dot, 4, 3)
        fp8_config = SkinnyConfig(64, 128, 8 if ON_GPU else 3, use_dot, 4, 3)
        calls += [lambda c=int4_config: w4a16_gemm(x, int4.qweight, int4.scales, int4.zeros, 128, None, c),
                  lambda c=fp8_config: w8a16_gemm(x, fp8.weight, fp8.scale, fp8.block, c)]
    for call in calls:
        first = call()
        assert_close(first, reference_int4(x, int4) if call in calls[::2] else
                     x.double() @ fp8.dequantize().double().T, 1e-5 if dtype == torch.float32 else 1e-2)
        for _ in range(repeats):
            assert torch.equal(call(), first)
        assert split_counters(x.device, 1).count_nonzero().item() == 0


# (N, K, block scales): per channel (a per-tensor checkpoint's scale arrives spread the same way) with N and K off
# the tiles, and 128 x 128 and 64 x 64 blocks with a last, partial block in each dimension.
SKINNY_FP8_SHAPES = [(200, 384, None), (130, 300, None), (256, 384, (128, 128)), (96, 320, (64, 64))]


@pytest.mark.parametrize("m, use_dot, split_k, n, k, block",
                         [rows + (split_k,) + shape for shape in SKINNY_FP8_SHAPES for rows in SKINNY_ROWS
                          for split_k in (1, 3)] + [(16, False, 3) + SKINNY_FP8_SHAPES[2]])
def test_w8a16_gemm_matches_float64(m, use_dot, split_k, n, k, block):
    """Both skinny FP8 kernels against the float64 product of the unquantized activations and the dequantized weight,
    per channel and per block, with one split and several (partial sums added by the reduction kernel)."""
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=generator)
    weight = Fp8Weight.quantize(torch.randn(n, k, generator=generator) * 0.05, block)
    weight.weight[0, :5] = torch.tensor([2.0**-9, -(2.0**-8), 3 * 2.0**-9, 448.0, -448.0]).to(FP8_DTYPE)  # subnormals
    expected = x.double() @ weight.dequantize().double().T
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    config = SkinnyConfig(block_n=32, block_k=64, split_k=split_k, use_dot=use_dot, num_warps=4, num_stages=2)
    out = w8a16_gemm(x.to(dtype).to(DEVICE), weight.weight.to(DEVICE), weight.scale.to(DEVICE), block, config)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, expected.to(DEVICE), 1e-5 if dtype == torch.float32 else 1e-2)
    assert SKINNY_MAX_ROWS == MAX_ROWS


@pytest.mark.parametrize("m", [1, 16])
def test_w8a16_gemm_default_configs_match_float64(m):
    generator = torch.Generator().manual_seed(m)
    n, k = 160, 1024
    x = torch.randn(m, k, generator=generator)
    for block in (None, (128, 128)):
        weight = Fp8Weight.quantize(torch.randn(n, k, generator=generator) * 0.05, block)
        dtype = torch.bfloat16 if ON_GPU else torch.float32
        out = w8a16_gemm(x.to(dtype).to(DEVICE), weight.weight.to(DEVICE), weight.scale.to(DEVICE), block)
        assert_close(out, (x.double() @ weight.dequantize().double().T).to(DEVICE), 1e-5 if not ON_GPU else 1e-2)


@pytest.mark.parametrize("m, use_dot, split_k", [(1, False, 1), (1, False, 3), (3, False, 2), (5, True, 1),
                                                 (16, True, 3)])
@pytest.mark.parametrize("n, k", [(200, 384), (130, 300)])
def test_w16a16_gemm_matches_float64(m, use_dot, split_k, n, k):
    """16-bit weights on the skinny kernels (no scale) against the float64 product, with N and K off the tiles. The
    interpreter multiplies bfloat16 tiles wrongly on tl.dot, so off a GPU the tensor-core kernel runs on float16."""
    generator = torch.Generator().manual_seed(m * 31 + n)
    x, weight = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator) * 0.05
    dtype = torch.bfloat16 if ON_GPU else (torch.float16 if use_dot else torch.bfloat16)
    config = SkinnyConfig(block_n=32, block_k=64, split_k=split_k, use_dot=use_dot, num_warps=4, num_stages=2)
    out = w16a16_gemm(x.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE), config)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = x.to(dtype).double() @ weight.to(dtype).double().T
    assert_close(out, expected.to(DEVICE), 1e-2)
    default = w16a16_gemm(x.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE))
    if ON_GPU or not (m > 1):  # the default takes the tensor cores from two rows
        assert_close(default, expected.to(DEVICE), 1e-2)


def test_fp8_quantization_round_trips_within_e4m3_precision():
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(0)) * 3
    for group in (None, 128):
        q, scale = quantize_per_row(x, group)
        assert q.dtype == FP8_DTYPE
        expanded = scale if group is None else scale.repeat_interleave(group, 1)[:, :300]
        # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 for normal values.
        error = (q.float() * expanded - x).abs()
        assert (error <= x.abs() * 2**-4 + expanded * 2**-9).all()
        assert q.float().abs().max() <= 448


@pytest.mark.parametrize("activation", [ActivationScheme.TOKEN, ActivationScheme.TENSOR])
def test_fp8_linear_per_channel_matches_its_quantized_operands(activation):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 256, generator=generator)
    weight = Fp8Weight.quantize(torch.randn(128, 256, generator=generator) * 0.05)
    if activation is ActivationScheme.TOKEN:
        x_q, x_scale = quantize_per_row(x)
    else:
        x_scale = x.abs().amax() / 448
        x_q = (x / x_scale).to(FP8_DTYPE)
    expected = (x_q.double() * x_scale.double()) @ weight.dequantize().double().T
    if ON_GPU:  # 6 rows: the skinny kernel's product of the unquantized activations (kernels/fp8_skinny_gemm.py)
        expected = x.double() @ weight.dequantize().double().T
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    device_weight = Fp8Weight(weight.weight.to(DEVICE), weight.scale.to(DEVICE))
    out = fp8_linear(x.to(dtype).to(DEVICE), device_weight, activation, None)
    # bfloat16 rounds x before it is quantized on the GPU, and the output: a few parts in a thousand there.
    assert_close(out, expected.to(DEVICE), 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at Llama-3.1-8B shapes and CUDA graphs need a GPU")
@pytest.mark.parametrize("m", [1, 16, 256, 1024])
@pytest.mark.parametrize("n, k", LLAMA_8B_SHAPES)
def test_gpu_kernels_at_llama_8b_shapes(m, n, k):
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    weight = random_int4(n, k, 128, False, torch.bfloat16)
    assert_close(w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 128), reference_int4(x, weight), 1e-2)
    x_q, x_scale, block = random_fp8_block_operands(m, n, k)
    expected = (x_q.double() * x_scale.double().repeat_interleave(128, 1)[:, :k]) @ block.dequantize().double().T
    out = fp8_block_gemm(x_q.to(DEVICE), x_scale.to(DEVICE), block.weight.to(DEVICE), block.scale.to(DEVICE),
                         (128, 128), torch.bfloat16)
    assert_close(out, expected.to(DEVICE), 1e-2)
    channel = Fp8Weight.quantize(torch.randn(n, k, device=DEVICE) * 0.05)
    x_q, row_scale = quantize_per_row(x)
    expected = (x_q.double() * row_scale.double()) @ channel.dequantize().double().T
    if m <= SKINNY_MAX_ROWS:  # the unquantized activations times the weight dequantized in registers
        expected = x.double() @ channel.dequantize().double().T
    assert_close(fp8_linear(x, channel, ActivationScheme.TOKEN, None), expected, 1e-2)


@pytest.mark.skipif(not ON_GPU, reason="bfloat16 at Llama-3.1-8B shapes needs a GPU")
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("n, k", LLAMA_8B_SHAPES)
def test_gpu_skinny_kernels_at_llama_8b_shapes(use_dot, n, k):
    """Each skinny kernel, compiled, in bfloat16 at 1, 4 and 16 rows: W4A16 in groups of 128 with and without
    act-order, FP8 per channel and in 128 x 128 blocks; the default split for the shape."""
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for act_order in (False, True):
        weight = random_int4(n, k, 128, act_order, torch.bfloat16)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            config = skinny_config(m, n, k, 128, act_order, num_sms)._replace(use_dot=use_dot)
            if use_dot and not act_order:  # a tuned FMA row's K tile may span groups; on the tensor cores it may not
                config = config._replace(block_k=min(config.block_k, 128))
            out = w4a16_gemm(x, weight.qweight, weight.scales, weight.zeros, 128, weight.g_idx, config)
            assert_close(out, reference_int4(x, weight), 1e-2)
    for block in (None, (128, 128)):
        weight = Fp8Weight.quantize(torch.randn(n, k, device=DEVICE) * 0.05, block)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            config = fp8_skinny_config(m, n, k, block, num_sms)._replace(use_dot=use_dot)
            out = w8a16_gemm(x, weight.weight, weight.scale, block, config)
            assert_close(out, x.double() @ weight.dequantize().double().T, 1e-2)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_gpu_kernels_replay_in_a_cuda_graph():
    n, k = 4096, 4096
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    int4 = random_int4(n, k, 128, False, torch.bfloat16)
    fp8 = Fp8Weight.quantize(torch.randn(n, k, device=DEVICE) * 0.05, (128, 128))
    channel = Fp8Weight.quantize(torch.randn(n, k, device=DEVICE) * 0.05)

    def step():
        return (w4a16_gemm(x, int4.qweight, int4.scales, int4.zeros, 128),
                fp8_linear(x, fp8, ActivationScheme.GROUP, None), fp8_linear(x, channel, ActivationScheme.TOKEN, None))

    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    eager = step()
    graph.replay()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m, k, group", [(1, 256, None), (5, 300, None), (3, 384, 128), (4, 200, 128)])
def test_fp8_quantize_kernel_matches_the_torch_definition(m, k, group):
    from radixserve.kernels.fp8_quant import quantize_fp8
    from radixserve.model_runner.quantization import fp8

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 5
    x[0, :7] = 0.0
    q, scale = quantize_fp8(x.to(DEVICE), group)
    expected_q, expected_scale = fp8.quantize_per_row(x, group)  # the torch path on the CPU
    torch.testing.assert_close(scale.cpu(), expected_scale, rtol=0, atol=0)
    q, expected_q = q.cpu().float(), expected_q.float()
    if not ON_GPU:
        # The interpreter's float32 -> e4m3 cast drops the carry where rounding up reaches the next power of two
        # (126.4 becomes 64, not 128); the GPU's cvt rounds to nearest even. Elsewhere the values are the same.
        carry_lost = (expected_q.abs() == 2.0 ** expected_q.abs().log2().round()) & (q == expected_q / 2)
        q = torch.where(carry_lost, expected_q, q)
        assert carry_lost.float().mean() < 0.05
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
