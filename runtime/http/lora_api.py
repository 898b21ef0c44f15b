"""LoRA adapters over HTTP: SGLang's `/load_lora_adapter` and `/unload_lora_adapter`, and the adapters as models of
the OpenAI routes.

Loading and unloading change the server for every tenant, so they are admin routes (runtime/http/access.py).
`/load_lora_adapter` reads a folder the client names, so it takes only folders under `--lora-adapter-dir` (links
followed, `..` resolved) and is refused (403) when that is not set: an adapter folder is code-free (safetensors or
a weights-only torch load), but the path alone must not let a caller probe the server's file system.
Both answer SGLang's body `{"success", "error_message", "loaded_adapters"}`; a failure is a 400 that also carries
the OpenAI error envelope.

On the OpenAI routes a request picks an adapter by `model`: the adapter's name, or `<served model>:<adapter>`
(SGLang's form); `lora_path` (SGLang's extension field) names one too (openai/serving_common.py::check_model).
`/v1/models` lists each adapter as a model whose `parent` is the served model.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.generation import json_response
from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.state import ServerState
from radixserve.runtime.http.errors import APIError
from radixserve.runtime.http.openai.protocol import StrictModel, parse_request

router = access_router(Access.ADMIN)


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
async def load_lora_adapter(request: Request) -> Response:
    state = _state(request)
    body = parse_request(LoadLoRAAdapterRequest, await request.body())
    path = allowed_adapter_path(body.lora_path, state.server_args.lora_adapter_dir)
    reply = await state.engine.async_load_lora_adapter(body.lora_name, path, body.pinned)
    return _answer(reply)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    body = parse_request(UnloadLoRAAdapterRequest, await request.body())
    return _answer(await _state(request).engine.async_unload_lora_adapter(body.lora_name))


def allowed_adapter_path(lora_path: str, adapter_dir: Optional[str]) -> str:
    """`lora_path` resolved (a relative path is taken under `adapter_dir`), or a 403 unless it lies inside
    `adapter_dir` (--lora-adapter-dir) once links are followed; without that folder nothing loads over HTTP."""
    if adapter_dir is None:
        raise APIError("Loading adapters over HTTP is off: start the server with --lora-adapter-dir DIR to load "
                       "adapters from under DIR.", status_code=403, param="lora_path", code="lora_path_not_allowed")
    root = os.path.realpath(adapter_dir)
    path = os.path.realpath(os.path.join(root, lora_path))
    if os.path.commonpath([root, path]) != root:
        raise APIError(f"lora_path must lie under the server's adapter folder (--lora-adapter-dir); "
                       f"{lora_path!r} does not", status_code=403, param="lora_path", code="lora_path_not_allowed")
    return path


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "radixserve",
             "root": path, "parent": state.served_model_name, "max_model_len": state.context_len}
            for name, path in state.engine.lora_adapters.items()]
