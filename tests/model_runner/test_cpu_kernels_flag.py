"""`--cpu-kernels auto|torch|auto,-NAME...`: one server argument decides which C++ CPU kernels run
(runtime/wire/cpu_kernels.py, model_runner/cpu/dispatch.py).

`torch` keeps every CPU op on torch's own path, even in a process where the kernels are already loaded; greedy
output is the same token for token either way (the kernels compute the same functions). `auto,-NAME` takes the
named kernels out of the runner's dispatch table, and an unknown value is refused with the flag's name and what it
accepts.
"""

from __future__ import annotations

import pytest

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.dispatch import NO_ROWS
from radixserve.model_runner.cpu.small_batch import SmallBatchLinear
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import greedy_generate
from radixserve.runtime.wire.server_args import ServerArgs

PROMPTS = [[5, 17, 42, 99, 3, 250, 61, 8], [7, 120, 33, 14, 2, 301]]


def test_torch_keeps_the_kernels_off_and_the_output_the_same(tiny_model_dir):
    model = tiny_model_dir("llama")
    auto = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model, device="cpu", cpu_kernels="auto")))
    assert cpu_build.enabled()
    cpu_build.wait(timeout=600)  # the build is cached per machine; on a fresh one this compiles once
    with_kernels = greedy_generate(auto, PROMPTS, 8)
    torch_only = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model, device="cpu",
        cpu_kernels="torch")))
    try:
        assert not cpu_build.enabled() and not cpu_build.ready()
        assert greedy_generate(torch_only, PROMPTS, 8) == with_kernels
    finally:
        cpu_build.set_enabled(True)


def test_named_kernels_leave_the_runners_table(tiny_model_dir):
    args = ServerArgs(model_path=tiny_model_dir("llama"), device="cpu", cpu_kernels="auto, -small,-panel")
    runner = ModelRunner(RunnerConfig.from_server_args(args))
    route = runner.cpu_kernels.linear(runner.dtype)
    assert runner.cpu_kernels.enabled and (route.small, route.panel) == (NO_ROWS, NO_ROWS)
    down = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, SmallBatchLinear) and down.kernel_rows == NO_ROWS and down.panel.usable is False
    assert "cpu kernels: auto, -small,-panel on" in runner.cpu_kernels.describe()


@pytest.mark.parametrize("value", ["avx", "auto,-avx", "auto,panel", "torch,-panel", "-panel"])
def test_an_unknown_value_is_refused(value):
    with pytest.raises(ValueError, match="cpu_kernels must be auto, torch or auto followed by ,-NAME .*amx-prefill"):
        ServerArgs(cpu_kernels=value)
