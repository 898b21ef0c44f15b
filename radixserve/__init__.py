"""radixserve: an LLM serving runtime with a radix-tree prefix cache.

    from radixserve import Engine
    with Engine() as engine:                       # the embedded SmolLM2-135M-Instruct
        print(engine.generate("Hello", {"max_new_tokens": 16})["text"])

    from radixserve import function, gen, select  # the frontend DSL (SGLang's names: `import radixserve as sgl`)

Public names load lazily, so `import radixserve` stays cheap (no torch until an Engine is made).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("radixserve.runtime.engine", "Engine"),
    "ServerArgs": ("radixserve.runtime.wire.server_args", "ServerArgs"),
    "GenerateRequest": ("radixserve.runtime.wire.request", "GenerateRequest"),
    "GenerateReqInput": ("radixserve.runtime.wire.request", "GenerateRequest"),  # SGLang's name of it
    "EngineDeadError": ("radixserve.runtime.wire.errors", "EngineDeadError"),
    "ContextLengthExceededError": ("radixserve.runtime.wire.errors", "ContextLengthExceededError"),
    "EngineStartupError": ("radixserve.runtime.launch", "EngineStartupError"),
    "RequestFailedError": ("radixserve.runtime.wire.errors", "RequestFailedError"),
    "InvalidRequestError": ("radixserve.runtime.wire.errors", "InvalidRequestError"),
}
# The frontend DSL, SGLang's names: `from radixserve import function, gen, select, ...`.
_DSL_NAMES = (
    "function", "gen", "gen_int", "gen_string", "select", "separate_reasoning", "image", "video", "flush_cache",
    "get_server_info", "global_config", "Runtime", "RuntimeEndpoint",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin",
    "user_end", "assistant_begin", "assistant_end", "set_default_backend", "EngineBackend",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
)
_LAZY.update({name: ("radixserve.frontend", name) for name in _DSL_NAMES})

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attribute = _LAZY[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
