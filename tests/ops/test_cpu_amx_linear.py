"""The bfloat16 AMX linear kernel (kernels/cpu_amx_linear.cpp), its decode and prefill loops, against float64, and
where the packed CPU linears (model_runner/cpu/packed.py) run it: the dispatch table's decode rows and prefill rows
(model_runner/cpu/dispatch.py), weights whose shape it takes, only where the tiles are granted, and not where
`--cpu-kernels` turns it off."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.amx_linear import AmxWeight, pack_for_tiles
from radixserve.model_runner.cpu.dispatch import choose, this_cpu
from radixserve.model_runner.cpu.packed import PackedLinear, packing_supported


@pytest.fixture(scope="module")
def amx():
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"
    if not torch.ops.radixserve_cpu.amx_linear_ready():
        pytest.skip("no AMX-BF16 tiles on this CPU (or not granted by the OS)")


def exact(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def ops_run(module, x) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        module(x)
    return {event.name for event in profile.events() if event.name.startswith(("radixserve_cpu::", "mkldnn::"))}


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (960, 576), (96, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(amx, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    bias_t = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    packed = pack_for_tiles(weight)
    for rows in (1, 5, 16, 17, 32, 33, 64, 128):  # whole and partial 32-row blocks
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        out = torch.ops.radixserve_cpu.amx_linear(x, packed, bias_t)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        # float32 sums of exact products, rounded once to bfloat16: within half a bfloat16 step (+ float32 noise)
        torch.testing.assert_close(out.double(), exact(x, weight, bias_t), rtol=2 ** -8, atol=1e-3)
    x = torch.randn(2, 3, in_features, generator=gen).to(torch.bfloat16)  # leading dimensions are kept
    assert torch.ops.radixserve_cpu.amx_linear(x, packed, bias_t).shape == (2, 3, out_features)


# (out_features, in_features): one column block and K shorter than a slice; K of one tile, 19 column blocks (an
# uneven split between threads); K in slices (1536: 6 x 8; 352: 6 + 5, uneven; 576: 2 x 9); a thread's
# columns in more than one chunk of L2-sized panels (3,072 x 576: chunks of 28 column blocks of 32).
PREFILL_SHAPES = [(32, 64), (608, 32), (96, 1536), (64, 352), (960, 576), (3072, 576)]


@pytest.mark.parametrize("out_features,in_features", PREFILL_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_loop_matches_float64(amx, out_features, in_features, threads):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    packed = pack_for_tiles(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 17, 32, 33, 200, 256, 300, 513):  # whole and partial 32-row blocks; partial 16-row tiles
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            for b in (None, bias):
                out = torch.ops.radixserve_cpu.amx_gemm(x, packed, b)
                assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
                torch.testing.assert_close(out.double(), exact(x, weight, b), rtol=2 ** -8, atol=1e-3)
    finally:
        torch.set_num_threads(previous)
    x = torch.randn(2, 300, in_features, generator=gen).to(torch.bfloat16)  # leading dimensions are kept
    assert torch.ops.radixserve_cpu.amx_gemm(x, packed, None).shape == (2, 300, out_features)
    assert torch.ops.radixserve_cpu.amx_gemm(x[:, :0], packed, None).shape == (2, 0, out_features)


def test_refuses_shapes_it_does_not_take(amx):
    weight = torch.randn(48, 64).to(torch.bfloat16)  # 48 output columns: not whole blocks of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.radixserve_cpu.amx_linear(torch.randn(5, 64).to(torch.bfloat16), pack_for_tiles(weight), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.radixserve_cpu.amx_gemm(torch.randn(300, 64).to(torch.bfloat16), pack_for_tiles(weight), None)
    packed = pack_for_tiles(torch.randn(64, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dimension of 64"):
        torch.ops.radixserve_cpu.amx_gemm(torch.randn(300, 96).to(torch.bfloat16), packed, None)
    odd = AmxWeight(torch.randn(80, 96).to(torch.bfloat16), this_cpu().linear(torch.bfloat16))
    assert odd.linear(torch.randn(8, 96).to(torch.bfloat16), None) is None


@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
def test_packed_linear_runs_it_at_decode_and_prefill_rows(amx):
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16).requires_grad_(False)
    module = PackedLinear(linear)
    route = this_cpu().linear(torch.bfloat16)
    (low, high), prefill_from = route.amx, route.amx_prefill_from
    for rows, expected in [(1, "radixserve_cpu::small_linear"),
                           (low, "radixserve_cpu::amx_linear"),
                           (high, "radixserve_cpu::amx_linear"),
                           (high + 1, "mkldnn::_linear_pointwise"),
                           (prefill_from - 1, "mkldnn::_linear_pointwise"),
                           (prefill_from, "radixserve_cpu::amx_gemm"),
                           (prefill_from + 300, "radixserve_cpu::amx_gemm")]:
        x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
        ran = ops_run(module, x)
        assert expected in ran, (rows, ran)
        torch.testing.assert_close(module(x).double(), exact(x, linear.weight, linear.bias), rtol=2 ** -8, atol=1e-3)
    off = PackedLinear(linear, copies=False)  # no copy (the memory rule said no): oneDNN's packed weight
    x = torch.randn(8, 96, generator=gen).to(torch.bfloat16)
    assert "radixserve_cpu::amx_linear" not in ops_run(off, x) and off.amx.packed is None


@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
def test_prefill_loop_turned_off_by_cpu_kernels(amx):
    kernels = choose("auto,-amx-prefill")
    module = PackedLinear(torch.nn.Linear(96, 64, bias=False).to(torch.bfloat16).requires_grad_(False),
                          kernels=kernels)
    ran = ops_run(module, torch.randn(this_cpu().linear(torch.bfloat16).amx_prefill_from, 96).to(torch.bfloat16))
    assert "radixserve_cpu::amx_gemm" not in ran and "mkldnn::_linear_pointwise" in ran
    assert "radixserve_cpu::amx_linear" in ops_run(module, torch.randn(8, 96).to(torch.bfloat16))


@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
def test_turned_off_by_cpu_kernels(amx):
    kernels = choose("auto,-amx")
    assert not kernels.amx_attention and this_cpu().amx_attention
    module = PackedLinear(torch.nn.Linear(96, 64, bias=False).to(torch.bfloat16).requires_grad_(False),
                          kernels=kernels)
    x = torch.randn(8, 96).to(torch.bfloat16)
    assert "radixserve_cpu::amx_linear" not in ops_run(module, x) and module.amx.usable is False


@pytest.mark.slow
@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
def test_default_model_prefill_on_the_prefill_loop(amx, default_model_dir):
    """A 300-token bfloat16 prefill of the embedded model through the prefill loop: its last-token logits are as
    close to float32's as those of the same prefill on oneDNN, and the top token agrees."""
    from test_model_forward import make_runner, run_extend

    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    exact = run_extend(make_runner(default_model_dir), [prompt], [0]).float()
    runner = make_runner(default_model_dir, dtype="bfloat16")
    packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        tiles = run_extend(runner, [prompt], [0]).float()
    assert "radixserve_cpu::amx_gemm" in {event.name for event in profile.events()}
    for module in packed:  # the same runner, prefill back on oneDNN
        module.amx.prefill_from = None
    onednn = run_extend(runner, [prompt], [0]).float()
    assert torch.equal(tiles.argmax(-1), exact.argmax(-1)) and torch.equal(onednn.argmax(-1), exact.argmax(-1))
    tiles_error, onednn_error = (tiles - exact).abs().max(), (onednn - exact).abs().max()
    assert tiles_error <= 1.5 * onednn_error + 0.05, (tiles_error, onednn_error)
