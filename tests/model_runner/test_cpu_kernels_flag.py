"""`--cpu-kernels auto|torch`: one server argument decides whether the C++ CPU kernels run (kernels/cpu_build.py).

`torch` keeps every CPU op on torch's own path, even in a process where the kernels are already loaded; greedy
output is the same token for token either way (the kernels compute the same functions), and an unknown value is
refused with the flag's name.
"""

from __future__ import annotations

import pytest

from radixserve.kernels import cpu_build
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.static_generate import greedy_generate
from radixserve.runtime.wire.server_args import ServerArgs

PROMPTS = [[5, 17, 42, 99, 3, 250, 61, 8], [7, 120, 33, 14, 2, 301]]


def test_torch_keeps_the_kernels_off_and_the_output_the_same(tiny_model_dir):
    model = tiny_model_dir("llama")
    auto = ModelRunner(ServerArgs(model_path=model, device="cpu", cpu_kernels="auto"))
    assert cpu_build.enabled()
    cpu_build.wait(timeout=600)  # the build is cached per machine; on a fresh one this compiles once
    with_kernels = greedy_generate(auto, PROMPTS, 8)
    torch_only = ModelRunner(ServerArgs(model_path=model, device="cpu", cpu_kernels="torch"))
    try:
        assert not cpu_build.enabled() and not cpu_build.ready()
        assert greedy_generate(torch_only, PROMPTS, 8) == with_kernels
    finally:
        cpu_build.set_enabled(True)


def test_an_unknown_value_is_refused():
    with pytest.raises(ValueError, match="cpu_kernels must be auto or torch"):
        ServerArgs(cpu_kernels="avx")
