"""LoRA adapters over HTTP: SGLang's `/load_lora_adapter` and `/unload_lora_adapter`, and the adapters as models of
the OpenAI routes.

Loading and unloading change the server for every tenant, so they need the administrator (runtime/tenancy.py).
Both answer SGLang's body `{"success", "error_message", "loaded_adapters"}`; a failure is a 400 that also carries
the OpenAI error envelope.

On the OpenAI routes a request picks an adapter by `model`: the adapter's name, or `<served model>:<adapter>`
(SGLang's form); `lora_path` (SGLang's extension field) names one too (openai/serving_common.py::check_model).
`/v1/models` lists each adapter as a model whose `parent` is the served model.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.generation import json_response
from radixserve.runtime.http.state import ServerState, caller, require_admin
from radixserve.runtime.http.errors import APIError
from radixserve.runtime.http.openai.protocol import StrictModel, parse_request
from radixserve.runtime.tenancy import Caller

router = APIRouter()


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _answer(reply: Any) -> Response:
    body = {"success": reply.success, "error_message": reply.error_message, "loaded_adapters": reply.loaded_adapters}
    if reply.success:
        return json_response(body)
    error = APIError(reply.error_message or "LoRA adapter request failed", status_code=reply.status_code,
                     param="lora_name", code="lora_adapter_error")
    return json_response({**body, **error.body()}, status_code=reply.status_code)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, who: Caller = Depends(caller)) -> Response:
    require_admin(who, "Loading a LoRA adapter")
    body = parse_request(LoadLoRAAdapterRequest, await request.body())
    reply = await _state(request).engine.async_load_lora_adapter(body.lora_name, body.lora_path, body.pinned)
    return _answer(reply)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, who: Caller = Depends(caller)) -> Response:
    require_admin(who, "Unloading a LoRA adapter")
    body = parse_request(UnloadLoRAAdapterRequest, await request.body())
    return _answer(await _state(request).engine.async_unload_lora_adapter(body.lora_name))


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "radixserve",
             "root": path, "parent": state.served_model_name, "max_model_len": state.context_len}
            for name, path in state.engine.lora_adapters.items()]
