"""The process-wide default backend that programs run on when `run` gets no `backend=`."""

from __future__ import annotations

import threading
from typing import Any, Optional

from radixserve.frontend.backends.base import Backend

_lock = threading.Lock()
_default: Optional[Backend] = None


def as_backend(value: Any) -> Backend:
    """`value` as a Backend: a Backend as is, a `Runtime` as its endpoint, a radixserve Engine wrapped in an
    EngineBackend."""
    if isinstance(value, Backend):
        return value
    if isinstance(getattr(value, "endpoint", None), Backend):  # a Runtime (a server launched from the script)
        return value.endpoint
    if callable(getattr(value, "generate", None)) and hasattr(value, "tokenizer"):
        from radixserve.frontend.backends.engine_backend import EngineBackend

        return EngineBackend(value)
    raise TypeError(f"not a backend: {type(value).__name__} (use RuntimeEndpoint(url), a Runtime, an Engine, "
                    f"or an EngineBackend)")


def set_default_backend(backend: Any) -> Optional[Backend]:
    """Make `backend` (a Backend, a Runtime or an Engine) the default for every program; returns the Backend.
    None clears the default."""
    global _default
    resolved = None if backend is None else as_backend(backend)
    with _lock:
        _default = resolved
    return resolved


def get_default_backend() -> Optional[Backend]:
    with _lock:
        return _default


def resolve_backend(backend: Any = None) -> Backend:
    """`backend` if given, else the default; ValueError when there is neither."""
    if backend is not None:
        return as_backend(backend)
    default = get_default_backend()
    if default is None:
        raise ValueError("no backend: call set_default_backend(RuntimeEndpoint(url)) or set_default_backend(engine), "
                         "or pass backend= to run()")
    return default
