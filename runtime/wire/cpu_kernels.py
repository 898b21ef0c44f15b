"""`--cpu-kernels`: which of radixserve's C++ CPU kernels may run (light: read by ServerArgs and by the runner).

    auto                  every kernel this CPU runs, where the dispatch table sends each call (the default)
    torch                 none: torch's own ops for every CPU call
    auto,-amx,-panel      auto without the kernels named after a minus

The names (what the runner does without each one, model_runner/cpu/dispatch.py):
    amx          AMX tiles: attention scores on AVX-512 dot products, bfloat16 linears on oneDNN's packed weights
    amx-prefill  the AMX linear's prefill loop: prefill row counts on oneDNN's packed weights (decode keeps AMX)
    panel        the column-panel linear of decode batches
    small        the small-row linear of one to a few rows
"""

from __future__ import annotations

from typing import Optional

CPU_KERNEL_NAMES = ("amx", "amx-prefill", "panel", "small")


def parse_cpu_kernels(spec: str) -> Optional[frozenset[str]]:
    """The kernels `spec` turns off (empty for `auto`), or None for `torch` (no C++ kernel at all). Raises
    ValueError, naming what is accepted, for anything else."""
    if spec == "torch":
        return None
    head, *rest = [part.strip() for part in spec.split(",")]
    off = {part[1:] for part in rest if part.startswith("-")}
    unknown = sorted(off - set(CPU_KERNEL_NAMES)) + [part for part in rest if not part.startswith("-")]
    if head != "auto" or unknown:
        raise ValueError(f"cpu_kernels must be auto, torch or auto followed by ,-NAME for each kernel to turn off "
                         f"(NAME one of {', '.join(CPU_KERNEL_NAMES)}), got {spec!r}")
    return frozenset(off)
