"""The column-panel linear kernel (kernels/cpu_panel_linear.cpp, `torch.ops.radixserve_cpu.panel_linear`) against
float64 products of the same numbers, its packing, and where the CPU linears route to it
(model_runner/cpu/panel_linear.py, small_batch.py, packed.py) by the dispatch table's rows (cpu/dispatch.py).

Row counts cover every block size of the micro-kernel (1-12 rows) and balanced splits of more rows; weights of one
and of many panels, inner sizes odd and even, with and without bias. Bounds as in tests/ops/test_cpu_linear.py: float32
within 1e-5 of the sum of |x_k w_k|; bfloat16 the float32 sum rounded once (half a bfloat16 step more).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.dispatch import LINEAR_ROWS, choose, this_cpu
from radixserve.model_runner.cpu.packed import PackedLinear, packing_supported
from radixserve.model_runner.cpu.panel_linear import PanelWeight, pack_panels
from radixserve.model_runner.cpu.small_batch import SmallBatchLinear, small_batch_packing_supported
from test_cpu_linear import check, make  # the float64 reference and its bounds


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built")
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


def supported(dtype: torch.dtype) -> bool:
    return bool(torch.ops.radixserve_cpu.panel_linear_supported(dtype))


def needs(dtype: torch.dtype) -> None:
    if not supported(dtype):
        pytest.skip(f"the panel kernel needs AVX-512 ({dtype}: AVX512_BF16 for bfloat16) on this CPU")


DTYPES = [torch.float32, torch.bfloat16]


def test_packing_puts_each_element_where_the_kernel_reads_it():
    w = torch.arange(64 * 6, dtype=torch.float32).view(64, 6)
    p = pack_panels(w)
    assert p.shape == (2, 6, 32) and p[1, 4, 3] == w[32 + 3, 4]
    b = pack_panels(w.to(torch.bfloat16))
    assert b.shape == (2, 3, 32, 2) and b[1, 2, 3, 1] == w[32 + 3, 2 * 2 + 1].to(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", list(range(1, 26)) + [37, 64, 100, 128])
def test_every_row_count(dtype, m):
    needs(dtype)
    for n, k in [(32, 34), (96, 100), (64, 48)]:
        x, weight, _ = make(m, n, k, dtype, seed=m * 1000 + n, bias=False)
        check(x, weight, None, torch.ops.radixserve_cpu.panel_linear(x, pack_panels(weight), None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 16, 48, 64])
def test_model_shapes_with_bias(dtype, m):
    """The embedded model's projections, many panels per thread (the next panel prefetched), and a bias."""
    needs(dtype)
    for n, k in [(960, 576), (576, 1536)]:
        x, weight, bias = make(m, n, k, dtype, seed=n + k + m, bias=True)
        check(x, weight, bias, torch.ops.radixserve_cpu.panel_linear(x, pack_panels(weight), bias))
    x, weight, _ = make(m, 96, 64, dtype, seed=m, bias=False)
    leading = x.view(1, m, 64)  # leading dimensions are kept
    assert torch.ops.radixserve_cpu.panel_linear(leading, pack_panels(weight), None).shape == (1, m, 96)


def test_mismatched_operands_are_refused():
    needs(torch.float32)
    packed = pack_panels(torch.randn(64, 16))
    with pytest.raises(RuntimeError, match="last dimension must be 16"):
        torch.ops.radixserve_cpu.panel_linear(torch.randn(3, 15), packed, None)
    with pytest.raises(RuntimeError, match="x is"):
        torch.ops.radixserve_cpu.panel_linear(torch.randn(3, 16).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="packed by"):
        torch.ops.radixserve_cpu.panel_linear(torch.randn(3, 16), torch.randn(64, 16), None)


def panel_ran(module, x) -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        module(x)
    return any(event.name == "radixserve_cpu::panel_linear" for event in profile.events())


@pytest.mark.skipif(not small_batch_packing_supported(), reason="needs oneDNN float32 linears")
def test_float32_linears_run_it_for_their_rows():
    needs(torch.float32)
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 40, generator=generator), torch.randn(96, generator=generator)
    module, head = SmallBatchLinear(weight, bias), SmallBatchLinear(weight, None, head=True)
    (low, high), (head_low, head_high) = LINEAR_ROWS["panel"][torch.float32]
    assert this_cpu().linear(torch.float32).panel == (low, high)
    for rows in (1, low, 8, 33, high, high + 1, 300):
        x = torch.randn(rows, 40, generator=generator)
        assert panel_ran(module, x) == (low <= rows <= high)
        assert panel_ran(head, x) == (head_low <= rows <= head_high)
        torch.testing.assert_close(module(x), F.linear(x.double(), weight.double(), bias.double()).float(),
                                   rtol=1e-5, atol=1e-5)
    x = torch.randn(8, 40, generator=generator)
    assert not panel_ran(SmallBatchLinear(weight, bias, panel=False), x)  # no copy under the memory rule
    assert not panel_ran(SmallBatchLinear(torch.randn(100, 40), None), x)  # 100 columns: not whole panels
    assert not panel_ran(SmallBatchLinear(weight, bias, kernels=choose("auto,-panel")), x)
    assert PanelWeight(weight, this_cpu().linear(torch.float32)).linear(x, None) is not None


@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
def test_bfloat16_packed_linears_run_it_without_amx():
    needs(torch.bfloat16)
    linear = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16).requires_grad_(False)
    module = PackedLinear(linear)
    generator = torch.Generator().manual_seed(3)
    low, high = LINEAR_ROWS["panel"][torch.bfloat16][0]
    amx_cpu = cpu_build.has_cpu_flag("amx_bf16")  # there the AMX kernel has these rows: no panel copy
    for rows in (1, low, 24, high, high + 1):
        x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
        assert panel_ran(module, x) == (not amx_cpu and low <= rows <= high)
        check(x, linear.weight, linear.bias, module(x))
    assert not panel_ran(PackedLinear(linear, copies=False), torch.randn(8, 64).to(torch.bfloat16))
    assert not panel_ran(PackedLinear(linear, kernels=choose("auto,-panel")), torch.randn(8, 64).to(torch.bfloat16))
