"""What the HTTP server (runtime/http/) needs of the engine it serves, and all it may use of one.

Two implement it: the in-process `Engine` (runtime/engine.py) and the Ray ingress's `EngineProxy`
(runtime/ray_serve/proxy.py), which forwards each call to the replicas. tests/engine/test_serving_engine.py checks both
against this protocol, statically and by signature, so a method added to one and not the other fails the suite.
`create_app` refuses an engine that lacks a member (`isinstance` on this runtime-checkable protocol).

Contract, for both implementations:
- `generate_request` yields the request's chunks (its one final result when not streaming); bad arguments raise
  ValueError at the first `__anext__`, before anything is queued; closing or cancelling the iteration aborts the
  unfinished requests.
- The `async_*` methods run on the caller's event loop without blocking it.
- A dead engine raises EngineDeadError (runtime/wire/errors.py) from every call but `is_healthy`, which says False.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional, Protocol, Union, runtime_checkable

from radixserve.runtime.wire.cache_tree import CacheTreeSummary
from radixserve.runtime.wire.lora import LoRAAdapterReqOutput
from radixserve.runtime.wire.request import GenerateRequest, NormalizedRequest
from radixserve.runtime.wire.server_args import ServerArgs
from radixserve.runtime.wire.server_info import ModelInfo, ServerInfo

# Called once per finished request with its meta_info and the arrival times of its output chunks.
RequestObserver = Callable[[dict[str, Any], list[float]], None]


@runtime_checkable
class ServingEngine(Protocol):
    model_info: ModelInfo  # the model served; its pool sizes are the whole app's (they size HTTP admission)
    tokenizer: Any  # the model's Hugging Face tokenizer (echo and logprob token texts)
    server_args: ServerArgs
    request_observer: Optional[RequestObserver]  # set by the app (its metrics and per-tenant usage)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters, name -> path."""

    def generate_request(self, obj: Union[GenerateRequest, NormalizedRequest]) -> AsyncIterator[Any]: ...

    async def async_encode(self, text: str) -> list[int]:
        """Token ids of `text` (ValueError past the context length)."""

    async def async_encode_chat(self, conversation: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation through the chat template (ValueError when the template refuses it)."""

    async def async_server_info(self) -> ServerInfo: ...

    async def async_flush_cache(self) -> bool:
        """Drop the prefix cache; False when it was refused (requests are running)."""

    async def async_get_cache_tree(self, **fields: Any) -> CacheTreeSummary:
        """A summary of the radix tree; `fields` are CacheTreeReq's."""

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str,
                                      pinned: bool = False) -> LoRAAdapterReqOutput: ...

    async def async_unload_lora_adapter(self, lora_name: str) -> LoRAAdapterReqOutput: ...

    async def async_post_training(self, request_type: type, **fields: Any) -> Any:
        """The merged reply to a request of runtime/wire/weights.py (weights, memory, pause; docs/rl.md)."""

    def abort(self, rid: str, tenant: Optional[str] = None) -> None:
        """Abort request `rid` of `tenant` (all its samples), wherever it is; unknown rids are ignored."""

    def is_healthy(self) -> bool: ...
