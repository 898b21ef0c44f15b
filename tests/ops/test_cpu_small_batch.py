"""float32 few-row linears (model_runner/cpu/small_batch.py): the small-row C++ kernel, pre-packed oneDNN weights or
`F.linear` by row count, the same products as `F.linear` (exactly `F.linear` outside the kernel's and the packed
row ranges), installed by the runner on float32 CPU models (with a packed copy when speculative decoding is on or the
copy is small next to the machine's memory); the bfloat16 packed linears' kernel rows (model_runner/cpu/packed.py);
and the dispatch table's rows of the kernel (model_runner/cpu/dispatch.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu import small_batch
from radixserve.model_runner.cpu.dispatch import NO_ROWS, choose, this_cpu
from radixserve.model_runner.cpu.packed import PackedLinear, packing_supported
from radixserve.model_runner.cpu.small_batch import SmallBatchLinear, small_batch_packing_supported
from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
from radixserve.runtime.wire.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not small_batch_packing_supported(), reason="needs oneDNN float32 linears")


@pytest.fixture(scope="module")
def kernels():
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


def kernel_ran(module, x, op: str = "radixserve_cpu::small_linear") -> bool:
    """Whether `module(x)` ran the C++ kernel (or `op`), from torch's profile of the call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        module(x)
    return any(event.name == op for event in profile.events())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_small_batch_linear_matches_linear(kernels, bias, packed):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=generator)
    bias_t = torch.randn(200, generator=generator) if bias else None
    module = SmallBatchLinear(weight, bias_t, packed=packed)
    route = this_cpu().linear(torch.float32)
    (low, high), packed_from = route.small, route.packed_from
    assert (low, high) == module.kernel_rows and low <= 2 and high >= 8
    for rows in sorted({1, 2, 3, packed_from, 6, high, high + 1, 64, 65, 300, 600}):
        x = torch.randn(rows, 96, generator=generator)
        want = F.linear(x.double(), weight.double(), None if bias_t is None else bias_t.double()).float()
        got = module(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        in_kernel = low <= rows <= high
        assert kernel_ran(module, x) == in_kernel
        on_packed = packed and not in_kernel and rows >= packed_from
        assert kernel_ran(module, x, "mkldnn::_linear_pointwise") == on_packed
        if not in_kernel and not on_packed:
            assert torch.equal(got, F.linear(x, weight, bias_t))  # F.linear itself
    x = torch.randn(2, 3, 96, generator=generator)  # leading dimensions are kept
    torch.testing.assert_close(module(x), F.linear(x, weight, bias_t), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
def test_bfloat16_packed_linear_runs_the_kernel_at_few_rows(kernels):
    linear = torch.nn.Linear(96, 80, bias=True).to(torch.bfloat16).requires_grad_(False)
    # copies=False: the AMX kernel (tests/ops/test_cpu_amx_linear.py) takes these rows first where the CPU has tiles
    module, head = PackedLinear(linear, copies=False), PackedLinear(linear, head=True, copies=False)
    low, high = module.kernel_rows
    assert low == 1 and high >= 1 and head.kernel_rows[1] <= high
    generator = torch.Generator().manual_seed(1)
    for rows in range(1, high + 3):
        x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
        assert kernel_ran(module, x) == (rows <= high)
        assert kernel_ran(head, x) == (rows <= head.kernel_rows[1])
        exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        torch.testing.assert_close(module(x).double(), exact, rtol=2 ** -8, atol=1e-3)


def test_runner_installs_them_and_verify_chain_logits_agree(kernels, tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama")
    # a few MB: packed by default
    small = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cpu")))
    assert small.model.model.layers[0].mlp.down_proj._packed is not None
    monkeypatch.setattr(small_batch, "MAX_EXTRA_MEMORY_FRACTION", 0.0)  # as for a model too large to copy
    plain = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cpu")))
    spec = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cpu",
        speculative_algorithm="NGRAM")))
    for runner, packed in ((plain, False), (spec, True)):  # the kernel needs no copy; the packed path does
        layer = runner.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj, SmallBatchLinear)
        assert isinstance(runner.model.logits_head, SmallBatchLinear)
        assert (layer.mlp.down_proj._packed is not None) == packed
        assert runner.model.logits_head.kernel_rows == runner.cpu_kernels.linear(torch.float32, head=True).small
    tokens = list(range(3, 40))

    def chain_logits(runner: ModelRunner, chain_len: int) -> torch.Tensor:
        row = runner.req_to_token_pool.alloc()
        slots = assign_kv_slots(runner.allocator, runner.req_to_token_pool, [row], [0], [len(tokens)])
        # A verify-sized chain: a prefix, then `chain_len` new tokens with logits at each.
        start = len(tokens) - chain_len
        prefix = make_forward_batch(ForwardMode.EXTEND, [row], [0], [tokens[:start]], slots[:start],
                                    runner.req_to_token_pool, runner.token_to_kv_pool)
        runner.forward(prefix)
        chain = make_forward_batch(ForwardMode.EXTEND, [row], [start], [tokens[start:]], slots[start:],
                                   runner.req_to_token_pool, runner.token_to_kv_pool,
                                   logits_indices=torch.arange(chain_len))
        logits = runner.forward(chain)
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)
        return logits

    for chain_len in (2, 7, 20):  # the kernel's rows; past them, the packed path on `spec`
        got = [chain_logits(runner, chain_len) for runner in (plain, spec)]
        with monkeypatch.context() as patch:  # the reference: the torch path throughout (F.linear, torch ops)
            patch.setattr(cpu_build, "ready", lambda: False)
            want = chain_logits(plain, chain_len)
        for logits in got:
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_cpu_kernels_without_small_keep_linears_off_the_kernel(kernels):
    weight = torch.randn(64, 32)
    x = torch.randn(6, 32)
    assert kernel_ran(SmallBatchLinear(weight, None, packed=False, panel=False), x)  # panel: its own test file
    off = choose("auto,-small")
    assert off.linear(torch.float32).small == NO_ROWS and off.linear(torch.bfloat16, head=True).small == NO_ROWS
    module = SmallBatchLinear(weight, None, packed=False, panel=False, kernels=off)
    assert not kernel_ran(module, x) and torch.equal(module(x), F.linear(x, weight))


def test_one_row_float32_projections_take_the_kernel_where_blas_streams_one_row_slowly():
    def small(vendor: str, dtype: torch.dtype, head: bool) -> tuple[int, int]:
        return choose("auto", flags={"avx2", "avx512f"}, vendor=vendor).linear(dtype, head=head).small

    for vendor in ("GenuineIntel", ""):  # MKL's one-row F.linear is fast on Intel; elsewhere nothing was measured
        assert small(vendor, torch.float32, False) == (2, 16) and small(vendor, torch.float32, True) == (1, 16)
    assert small("AuthenticAMD", torch.float32, False) == (1, 16)
    assert small("AuthenticAMD", torch.float32, True) == (1, 16)
    assert small("AuthenticAMD", torch.bfloat16, False) == (1, 4)
    assert choose("torch", vendor="AuthenticAMD").linear(torch.float32).small == NO_ROWS
