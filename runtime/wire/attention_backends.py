"""The attention backends a server may be asked for, and the devices each runs on: the server arguments refuse a
backend for another device before any process starts, and the model runner builds only what this check allows."""

from __future__ import annotations

import os
from typing import Optional

ATTENTION_BACKENDS = ("torch_native", "cpu", "triton", "flashinfer")
PREFILL_ATTENTION_BACKENDS = ("flashinfer", "fa3")  # SGLang's names; FlashInfer's FA2 and FA3 extend kernels


def device_refusal(backend: Optional[str], device_type: str) -> Optional[str]:
    """Why attention backend `backend` cannot run on a `device_type` device, or None where it can. Triton compiles
    for a GPU; off one it runs only under its interpreter (`TRITON_INTERPRET=1`, the tests' way: far too slow to
    serve with), and without that it fails on the first batch for want of a driver."""
    if backend == "cpu" and device_type != "cpu":
        return "the cpu attention backend runs on the CPU; use flashinfer, triton or torch_native"
    if backend == "flashinfer" and device_type != "cuda" or (
            backend == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return (f"the {backend} attention backend needs a CUDA device, and this server runs on the {device_type}; "
                f"use the cpu or torch_native attention backend")
    return None
