"""`radixserve check-env`: the versions this installation resolved and the machine it runs on, one line each.

`make test` prints it first, so every test log records what it ran against (torch, transformers, xgrammar,
flashinfer on a GPU, Hugging Face's `kernels`), the CPU's instruction sets, the device, and whether any of the
checkout's top-level folders is importable under its bare name (it never should be; see `import_path.py`).
Exit status 1 when one is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import sys

from radixserve.runtime.import_path import bare_imports_into_checkout

DISTRIBUTIONS = ("radixserve", "torch", "transformers", "tokenizers", "xgrammar", "flashinfer-python", "triton",
                 "kernels", "gguf", "msgspec", "pyzmq", "fastapi", "uvicorn")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-device", action="store_true", help="skip the CPU and GPU lines (no torch import)")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_lines() -> list[str]:
    import torch

    from radixserve.kernels.cpu_build import cpu_isa, cpu_vendor

    lines = [f"cpu: {platform.processor() or platform.machine()} {cpu_vendor()}; isa: {cpu_isa()}; "
             f"torch threads {torch.get_num_threads()}"]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"cuda:{index}: {props.name}, {props.total_memory / (1 << 30):.1f} GiB, "
                         f"CUDA {torch.version.cuda}")
    else:
        lines.append("cuda: not available")
    return lines


def run(args: argparse.Namespace) -> int:
    lines = [f"python: {sys.version.split()[0]} ({sys.executable})"]
    lines += [f"{name}: {_version(name)}" for name in DISTRIBUTIONS]
    if not args.no_device:
        lines += _device_lines()
    kernels = importlib.util.find_spec("kernels")
    lines.append(f"import kernels: {kernels.origin if kernels is not None else 'not found'}")
    shadowed = bare_imports_into_checkout()
    if shadowed:
        lines.append("import path: NOT CLEAN, bare imports find the checkout: "
                     + ", ".join(f"{name} -> {origin}" for name, origin in sorted(shadowed.items())))
    else:
        lines.append("import path: clean (no top-level folder of radixserve imports under its bare name)")
    print("\n".join(lines))
    return 1 if shadowed else 0
