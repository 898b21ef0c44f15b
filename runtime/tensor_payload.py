"""Tensors to and from the bytes of a `TensorPayload` (runtime/wire/weights.py), for the processes that hold tensors:
the Engine's (weights a trainer hands over) and the schedulers' (weights read back)."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.runtime.wire.weights import TensorPayload


def tensor_payload(name: str, tensor: Any) -> TensorPayload:
    """A tensor as bytes that can cross a socket (copied to the CPU when it lives on a device)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return TensorPayload(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data)


def payload_tensor(payload: TensorPayload) -> Any:
    """The tensor of a payload, on the CPU (ValueError for an unknown dtype or bytes that do not fit the shape)."""
    dtype = getattr(torch, payload.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight {payload.name!r}: unknown dtype {payload.dtype!r}")
    count = 1
    for size in payload.shape:
        count *= size
    if len(payload.data) != count * torch.empty((), dtype=dtype).element_size():
        raise ValueError(f"weight {payload.name!r}: {len(payload.data)} bytes do not hold {payload.dtype} "
                         f"{tuple(payload.shape)}")
    if not count:
        return torch.empty(payload.shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(payload.shape)
