"""The process-wide default backend that programs run on when `run` gets no `backend=`."""

from __future__ import annotations

import threading
from typing import Any, Optional

from radixserve.frontend.backends.base import Backend

_lock = threading.Lock()
_default: Any = None  # as given: a Backend, a Runtime or an Engine


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
    """Make `backend` (a Backend, a Runtime or an Engine) the default for every program; returns the Backend it
    runs programs on. None clears the default. The default is kept as given, as SGLang keeps it: after
    `set_default_backend(runtime)`, `get_default_backend()` is that Runtime (scripts call
    `.endpoint.get_model_name()` on it)."""
    global _default
    resolved = None if backend is None else as_backend(backend)  # a TypeError now, not when a program runs
    with _lock:
        _default = backend
    return resolved


def get_default_backend() -> Any:
    """The default backend as it was given to set_default_backend (None when there is none)."""
    with _lock:
        return _default


def resolve_backend(backend: Any = None) -> Backend:
    """`backend` if given, else the default, as a Backend; ValueError when there is neither."""
    if backend is not None:
        return as_backend(backend)
    default = get_default_backend()
    if default is None:
        raise ValueError("no backend: call set_default_backend(RuntimeEndpoint(url)) or set_default_backend(engine), "
                         "or pass backend= to run()")
    return as_backend(default)
