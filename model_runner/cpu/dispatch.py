"""The CPU dispatch table: which implementation runs each linear and attention call on the CPU, by row count,
weight dtype and the CPU's instruction set; chosen once per runner from the CPU's features and `--cpu-kernels`
(runtime/wire/cpu_kernels.py), and logged once.

A linear call of `rows` input rows takes the first route whose rows hold it:

    amx     kernels/cpu_amx_linear.cpp, decode loop            bfloat16, where the CPU has AMX-BF16
    amx     the same kernel's prefill loop, from `amx_prefill_from` rows
    panel   kernels/cpu_panel_linear.cpp (a copy of the weight in column panels)
    small   kernels/cpu_linear.cpp (reads the plain weight once); every row count under deterministic inference
    plain   `F.linear`, from `plain_from` rows (bfloat16 projections that do not widen, on AMX CPUs)
    packed  oneDNN's weight packed once (model_runner/cpu/packed.py, small_batch.py), from `packed_from` rows
    torch   `F.linear` for the rest

The attention's bfloat16 scores run on AMX tiles where the CPU has them (`amx_attention`), else on AVX-512 dot
products. Which routes a linear really takes also depends on what its module could make: the copies of the weight
for amx, panel and packed follow a memory rule, the kernels need shapes they support and a loaded library.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.kernels import cpu_build
from radixserve.runtime.wire.cpu_kernels import parse_cpu_kernels

logger = logging.getLogger(__name__)

Rows = tuple[int, int]  # inclusive; (1, 0) holds no row count
NO_ROWS: Rows = (1, 0)

# The table. Row ranges where each kernel measured fastest against the other paths (benchmarks/cpu_linear.py on the
# 2-core AMX and EPYC machines of docs/benchmarks.md; figures in docs/benchmarks/history/cpu.md and
# cache-and-speculative.md), per weight dtype: (projections, LM head).
LINEAR_ROWS: dict[str, dict[torch.dtype, tuple[Rows, Rows]]] = {
    "amx": {torch.bfloat16: ((2, 128), (2, 128))},
    "panel": {torch.float32: ((2, 128), (2, 32)), torch.bfloat16: ((2, 128), (2, 64))},
    "small": {torch.float32: ((2, 16), (1, 16)), torch.bfloat16: ((1, 4), (1, 1))},
}
# (kernel, dtype) -> (the CPU flag it needs, a flag that hands its rows to another kernel): the panel's bfloat16
# rows go to the AMX kernel where the CPU has tiles.
LINEAR_ISA: dict[tuple[str, torch.dtype], tuple[str, Optional[str]]] = {
    ("amx", torch.bfloat16): ("amx_bf16", None),
    ("panel", torch.float32): ("avx512f", None),
    ("panel", torch.bfloat16): ("avx512_bf16", "amx_bf16"),
    ("small", torch.float32): ("", None),
    ("small", torch.bfloat16): ("", None),
}
# (CPU vendor, kernel, dtype, LM head) -> rows in place of LINEAR_ROWS': torch's BLAS streams one float32 row
# slowly on AMD's CPUs, so the small-row kernel takes it there.
VENDOR_ROWS: dict[tuple[str, str, torch.dtype, bool], Rows] = {
    ("AuthenticAMD", "small", torch.float32, False): (1, 16),
}
# Deterministic inference: the small-row kernel sums each (input row, output column) alone, over K in one fixed order
# whatever the number of rows of the call (kernels/cpu_linear.cpp), so a row's result does not depend on its batch.
ALL_ROWS: Rows = (1, 1 << 62)
AMX_PREFILL_FROM = 256
PACKED_FROM = {torch.float32: 4, torch.bfloat16: 1}
NARROW_PLAIN_FROM = {torch.bfloat16: 384}  # where the CPU has AMX-BF16: oneDNN's plain matmul beats its packed one


@dataclass(frozen=True)
class LinearRoute:
    """Where one linear's calls go, by input rows (see the module docstring)."""

    amx: Rows = NO_ROWS
    amx_prefill_from: Optional[int] = None
    panel: Rows = NO_ROWS
    small: Rows = NO_ROWS
    plain_from: Optional[int] = None
    packed_from: int = 1


@dataclass(frozen=True)
class CpuKernels:
    """The dispatch table of one runner: this CPU's flags and vendor, and the kernels `--cpu-kernels` turned off
    (`off` None: `torch`, no C++ kernel at all)."""

    spec: str
    flags: frozenset[str]
    vendor: str
    off: Optional[frozenset[str]]
    batch_invariant: bool = False  # every row count on the small-row kernel (see `linear`)

    @property
    def enabled(self) -> bool:
        """Whether any C++ kernel may run (`--cpu-kernels torch`: none)."""
        return self.off is not None

    @property
    def amx_attention(self) -> bool:
        """Whether the attention's bfloat16 scores run on AMX tiles (where the OS grants them too)."""
        return self.runs("amx") and "amx_bf16" in self.flags

    def runs(self, kernel: str) -> bool:
        return self.off is not None and kernel not in self.off

    def linear(self, dtype: torch.dtype, head: bool = False, narrow: bool = False) -> LinearRoute:
        """The route of a linear whose weight has `dtype`: the LM head's (`head`), or a projection's (`narrow`: one
        whose out_features <= in_features)."""

        def rows(kernel: str) -> Rows:
            ranges, isa = LINEAR_ROWS[kernel].get(dtype), LINEAR_ISA.get((kernel, dtype))
            if ranges is None or isa is None or not self.runs(kernel):
                return NO_ROWS
            needs, yields_to = isa
            if (needs and needs not in self.flags) or (yields_to is not None and yields_to in self.flags):
                return NO_ROWS
            return VENDOR_ROWS.get((self.vendor, kernel, dtype, head), ranges[1 if head else 0])

        if self.batch_invariant and self.runs("small"):
            return LinearRoute(small=ALL_ROWS, packed_from=PACKED_FROM.get(dtype, 1))
        amx = rows("amx")
        prefill = AMX_PREFILL_FROM if amx != NO_ROWS and self.runs("amx-prefill") else None
        plain = NARROW_PLAIN_FROM.get(dtype) if narrow and "amx_bf16" in self.flags else None
        return LinearRoute(amx=amx, amx_prefill_from=prefill, panel=rows("panel"), small=rows("small"),
                           plain_from=plain, packed_from=PACKED_FROM.get(dtype, 1))

    def describe(self) -> str:
        """One line: the CPU and, per dtype, the rows of each kernel (projections; the LM head's after a slash)."""

        def span(rows: Rows) -> str:
            return "-" if rows == NO_ROWS else f"{rows[0]}-{rows[1]}"

        parts = [f"cpu kernels: {self.spec} on {','.join(f for f in cpu_build.ISA_FLAGS if f in self.flags) or '?'}"
                 f" ({self.vendor or 'unknown vendor'})"]
        if not self.enabled:
            return parts[0] + ": torch ops only"
        for dtype in (torch.float32, torch.bfloat16):
            proj, head = self.linear(dtype), self.linear(dtype, head=True)
            routes = [f"{kernel} {span(getattr(proj, kernel))}/{span(getattr(head, kernel))}"
                      for kernel in ("amx", "panel", "small") if (getattr(proj, kernel), getattr(head, kernel))
                      != (NO_ROWS, NO_ROWS)]
            if proj.amx_prefill_from is not None:
                routes.append(f"amx prefill {proj.amx_prefill_from}+")
            routes.append(f"packed {proj.packed_from}+")
            parts.append(f"{str(dtype).removeprefix('torch.')} linears {', '.join(routes)}")
        parts.append(f"attention scores on {'AMX tiles' if self.amx_attention else 'AVX-512/AVX2'}")
        return "; ".join(parts)


def choose(spec: str = "auto", flags: Optional[frozenset[str]] = None, vendor: Optional[str] = None,
           batch_invariant: bool = False) -> CpuKernels:
    """The table for `--cpu-kernels spec` on this CPU (or on one of `flags` and `vendor`, for tests); with
    `batch_invariant` (deterministic inference), every linear call on the small-row kernel."""
    return CpuKernels(spec, frozenset(cpu_build.cpu_flags().split()) if flags is None else frozenset(flags),
                      cpu_build.cpu_vendor() if vendor is None else vendor, parse_cpu_kernels(spec), batch_invariant)


@functools.lru_cache(maxsize=None)
def this_cpu() -> CpuKernels:
    """`--cpu-kernels auto` on this CPU: the table of linears built outside a runner (tests, benchmarks)."""
    return choose()


_logged: set[str] = set()


def log_once(kernels: CpuKernels) -> None:
    """Log the table at start-up, once per process and table (the runner of a draft model shares its target's)."""
    line = kernels.describe()
    if line not in _logged:
        _logged.add(line)
        logger.info("%s", line)
