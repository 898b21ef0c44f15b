"""Post-training over HTTP: SGLang's weight-update, memory and pause routes, with SGLang's bodies (docs/rl.md).

    POST /update_weights_from_disk         {"model_path", "load_format"?, "weight_version"?}
    POST /update_weights_from_tensor       {"named_tensors": [{"name", "dtype", "shape", "data": base64}], "load_format"?,
                                            "flush_cache"?, "weight_version"?}
    POST /init_weights_update_group        {"master_address", "master_port", "rank_offset", "world_size", "group_name"?,
                                            "backend"?}
    POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "group_name"?, "flush_cache"?, "weight_version"?}
    POST /destroy_weights_update_group     {"group_name"?}
    POST /get_weights_by_name              {"name", "truncate_size"?}  -> the values, a nested list
    GET  /get_weight_version               -> {"weight_version"}
    POST /release_memory_occupation        {"tags"?}
    POST /resume_memory_occupation         {"tags"?}
    POST /pause_generation                 {"mode"?: "abort" | "retract" | "in_place"}
    POST /continue_generation              {}

Each answers `{"success", "message", "weight_version"}`; a request that cannot be honoured is a 400 that carries the
OpenAI error envelope too. They change the server for every tenant: each needs the administrator (runtime/tenancy.py).

Tensors travel as their raw bytes in base64 with the dtype's name and the shape. SGLang's `serialized_named_tensors`
(pickled tensors) is refused: this server unpickles nothing it receives.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Optional

from fastapi import Depends
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.errors import APIError
from radixserve.runtime.http.generation import json_response
from radixserve.runtime.http.openai.protocol import StrictModel, parse_request
from radixserve.runtime.http.state import ServerState, caller, require_admin
from radixserve.runtime.tenancy import Caller
from radixserve.runtime.wire.weights import (
    ContinueGenerationReq, DestroyWeightsUpdateGroupReq, GetWeightsByNameReq, InitWeightsUpdateGroupReq,
    PauseGenerationReq, ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq, TensorPayload,
    UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq,
)

router = access_router(Access.ADMIN)  # SGLang's post-training calls act on every tenant
version_router = access_router(Access.TENANT)  # the version of the served weights, which every output carries too


class UpdateFromDisk(StrictModel):
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None


class NamedTensor(StrictModel):
    name: str
    dtype: str
    shape: list[int]
    data: str  # base64 of the tensor's raw bytes (C order)


class UpdateFromTensor(StrictModel):
    named_tensors: Optional[list[NamedTensor]] = None
    serialized_named_tensors: Optional[Any] = None
    load_format: Optional[str] = None
    flush_cache: bool = True
    weight_version: Optional[str] = None


class InitGroup(StrictModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateFromDistributed(StrictModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Optional[str] = None


class GroupName(StrictModel):
    group_name: str = "weight_update_group"


class WeightsByName(StrictModel):
    name: str
    truncate_size: int = 100


class MemoryTags(StrictModel):
    tags: Optional[list[str]] = None


class Pause(StrictModel):
    mode: str = "abort"


class NoFields(StrictModel):
    pass


def _payload(tensor: NamedTensor) -> TensorPayload:
    try:
        data = base64.b64decode(tensor.data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"named_tensors: the data of {tensor.name!r} is not base64", param="named_tensors") from None
    return TensorPayload(tensor.name, tensor.dtype, tensor.shape, data)


async def _call(request: Request, who: Caller, what: str, request_type: type, **fields: Any) -> Any:
    require_admin(who, what)
    state: ServerState = request.app.state.server
    return await state.engine.async_post_training(request_type, **fields)


def _answer(reply: Any) -> Response:
    body = {"success": reply.success, "message": reply.message, "weight_version": reply.weight_version}
    if reply.success:
        return json_response(body)
    error = APIError(reply.message or "the request failed", status_code=reply.status_code, code="post_training_error")
    return json_response({**body, **error.body()}, status_code=reply.status_code)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(UpdateFromDisk, await request.body())
    return _answer(await _call(request, who, "Updating the weights", UpdateWeightsFromDiskReq,
                               **body.model_dump()))


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(UpdateFromTensor, await request.body())
    if body.serialized_named_tensors is not None:
        raise APIError("serialized_named_tensors holds pickled tensors, which this server does not unpickle: send "
                       "named_tensors as [{name, dtype, shape, data (base64 of the raw bytes)}]",
                       param="serialized_named_tensors")
    if body.named_tensors is None:
        raise APIError("named_tensors is required", param="named_tensors")
    payloads = [_payload(tensor) for tensor in body.named_tensors]
    return _answer(await _call(request, who, "Updating the weights", UpdateWeightsFromTensorReq,
                               named_tensors=payloads, load_format=body.load_format, flush_cache=body.flush_cache,
                               weight_version=body.weight_version))


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(InitGroup, await request.body())
    return _answer(await _call(request, who, "Joining a weight-update group", InitWeightsUpdateGroupReq,
                               **body.model_dump()))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(UpdateFromDistributed, await request.body())
    return _answer(await _call(request, who, "Updating the weights", UpdateWeightsFromDistributedReq,
                               **body.model_dump()))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(GroupName, await request.body() or b"{}")
    return _answer(await _call(request, who, "Leaving a weight-update group", DestroyWeightsUpdateGroupReq,
                               **body.model_dump()))


@router.post("/get_weights_by_name")
async def get_weights_by_name(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(WeightsByName, await request.body())
    reply = await _call(request, who, "Reading the weights", GetWeightsByNameReq, **body.model_dump())
    if not reply.success:
        raise APIError(reply.message, param="name", status_code=getattr(reply, "status_code", 400))
    from radixserve.runtime.tensor_payload import payload_tensor  # torch: only when weights are read

    return json_response(payload_tensor(reply.parameter).float().tolist())


@version_router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    state: ServerState = request.app.state.server
    info = await state.engine.async_server_info()
    return json_response({"weight_version": info.model.weight_version})


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(MemoryTags, await request.body() or b"{}")
    return _answer(await _call(request, who, "Releasing memory", ReleaseMemoryOccupationReq, tags=body.tags))


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(MemoryTags, await request.body() or b"{}")
    return _answer(await _call(request, who, "Resuming memory", ResumeMemoryOccupationReq, tags=body.tags))


@router.post("/pause_generation")
async def pause_generation(request: Request, who: Caller = Depends(caller)) -> Response:
    body = parse_request(Pause, await request.body() or b"{}")
    return _answer(await _call(request, who, "Pausing generation", PauseGenerationReq, mode=body.mode))


@router.post("/continue_generation")
async def continue_generation(request: Request, who: Caller = Depends(caller)) -> Response:
    parse_request(NoFields, await request.body() or b"{}")
    return _answer(await _call(request, who, "Continuing generation", ContinueGenerationReq))
