"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step, on Hopper and later GPUs.

A decode step at a few tokens is a chain of eight to ten small kernels a layer (norm, QKV, rotary, attention with
the KV store, output projection, norm and router, experts or MLP; the store and the norm run on their own where their
fused forms do not apply), each reading a few megabytes. In a CUDA graph every kernel still
waits for the last CTA of the one before it to retire before its own CTAs are placed, their registers set up and
their first loads issued, and the SMs idle through each hand-over. Launched with PDL, a kernel's CTAs may be placed
as soon as every CTA of the kernel before it has started; they then block in `griddepcontrol.wait` until that kernel
has completed and its writes are visible. The launch and the set-up overlap the previous kernel's tail, the data
never does.

The rule every kernel launched this way keeps: each of its programs calls `wait_previous` before it reads or writes
global memory, whatever branch it takes (an early return included). A kernel then completes only after the one before
it did, so the chain is ordered transitively although each kernel waits only for its predecessor. `wait_previous` also
lets the next kernel be placed (`griddepcontrol.launch_dependents`), at most two kernels at a time. A kernel launched
without PDL (cuBLAS, torch ops, a kernel of an older GPU) waits for full completion, as any launch does, so PDL
kernels mix with any others on the stream.

`launch_options(tensor)` gives a kernel call its keyword arguments: `USE_PDL` (the kernel's constexpr) and, where it is
on, Triton's `launch_pdl`. It is on for CUDA devices of compute capability 9.0 or later while `ENABLED` (benchmarks set
it False for a side-by-side); on other devices, and under the Triton interpreter, the kernels compile without the
wait.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = True

_capable: dict[int, bool] = {}


def _compiled_with_pdl() -> bool:
    """Whether this process compiles Triton kernels for the device (not the interpreter, which the environment
    switches on before triton is imported) with a Triton that has the PDL instructions."""
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return (os.environ.get("TRITON_INTERPRET") != "1" and cuda is not None and hasattr(cuda, "gdc_wait")
            and hasattr(cuda, "gdc_launch_dependents"))


_COMPILED_WITH_PDL = _compiled_with_pdl()


def pdl_active(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    if not (ENABLED and _COMPILED_WITH_PDL and device.type == "cuda"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def launch_options(tensor: torch.Tensor) -> dict:
    """The keyword arguments of a PDL-aware kernel's launch on `tensor`'s device: `{"USE_PDL": True,
    "launch_pdl": True}` where PDL is active, else `{"USE_PDL": False}`."""
    if pdl_active(tensor.device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def wait_previous(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one completed and its writes are visible, then let the next kernel be
    placed. Each program of a kernel launched with PDL calls it before its first global memory access."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
