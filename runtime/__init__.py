"""radixserve.runtime: the Engine, server arguments, process launch and supervision, the HTTP server.

Light on import: `import radixserve.runtime.wire.messages` (or server_args) must not pull in torch, so the Engine
is loaded lazily on first attribute access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineDeadError", "EngineStartupError", "GenerateReqInput"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.runtime.engine import Engine

        return Engine
    if name == "EngineStartupError":
        from radixserve.runtime.launch import EngineStartupError

        return EngineStartupError
    if name == "EngineDeadError":
        from radixserve.runtime.wire.errors import EngineDeadError

        return EngineDeadError
    if name == "GenerateReqInput":
        from radixserve.runtime.wire.request import GenerateRequest

        return GenerateRequest
    raise AttributeError(f"module 'radixserve.runtime' has no attribute {name!r}")
