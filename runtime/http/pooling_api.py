"""Embeddings, rerank, score and classify over HTTP (runtime/pooling.py holds what they share with `Engine`).

- `POST /v1/embeddings` (OpenAI): `input` as a string, a list of strings, token ids or lists of token ids;
  `dimensions` (Matryoshka truncation, normalized again); `encoding_format` float or base64 (little-endian float32,
  as OpenAI encodes it); `usage`.
- `POST /v1/rerank` (also `/rerank`; the Jina/Cohere shape vLLM serves): `query`, `documents`, `top_n`,
  `return_documents`; results best first.
- `POST /v1/score` (SGLang's): `query`, `items`, `label_token_ids`, `apply_softmax`, `item_first`; `scores` per item.
- `POST /classify` (also `/v1/classify`; vLLM's shape): per input its `label`, `probs`, `num_classes`.

All are tenant routes: a request runs in its tenant's cache namespace, counts toward the queue limit and is aborted
when the client leaves, as generation is. A model that cannot serve a route answers 400 saying what it serves.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from fastapi import Depends
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from radixserve.runtime import pooling
from radixserve.runtime.http.access import Access, access_router
from radixserve.runtime.http.errors import bad_request, from_value_error
from radixserve.runtime.http.generation import ClientDisconnected, GenerationRun, json_response
from radixserve.runtime.http.openai.protocol import StrictModel, parse_request
from radixserve.runtime.http.openai.serving_common import check_model
from radixserve.runtime.http.state import ServerState, caller_tenant
from radixserve.runtime.wire.request import MAX_BATCH, GenerateRequest, RequestFieldError, normalize

CLIENT_CLOSED_REQUEST = 499
TokenId = Annotated[int, Field(ge=0)]
Input = Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)],
              Annotated[list[TokenId], Field(min_length=1)],
              Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH)]]
Text = Union[str, Annotated[list[TokenId], Field(min_length=1)]]
Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH)]


class EmbeddingRequest(StrictModel):
    input: Input
    model: Optional[str] = None
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None
    encoding_format: Literal["float", "base64"] = "float"
    user: Optional[str] = None
    cache_salt: Optional[str] = None


class RerankRequest(StrictModel):
    query: Text
    documents: Texts
    model: Optional[str] = None
    top_n: Optional[Annotated[int, Field(ge=1)]] = None
    return_documents: bool = True


class ScoreRequest(StrictModel):
    query: Text
    items: Union[Text, Texts]
    label_token_ids: Annotated[list[TokenId], Field(min_length=1)]
    apply_softmax: bool = False
    item_first: bool = False
    model: Optional[str] = None


class ClassifyRequest(StrictModel):
    input: Input
    model: Optional[str] = None


router = access_router(Access.TENANT)


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _run(request: Request, tenant: Optional[str], body: GenerateRequest) -> list[dict[str, Any]]:
    """Each prompt's result (`embedding`, `meta_info`), run as a generation route runs its requests."""
    state = _state(request)
    body = msgspec.structs.replace(body, tenant=tenant, tenant_weight=state.tenants.weight_of(tenant))
    try:
        normalized = normalize(body, state.model_info)
    except ValueError as error:
        raise from_value_error(error, param=getattr(error, "field", None)) from None
    run = GenerationRun(state, normalized.sample_rids(), [normalized], tenant, request)
    try:
        results = await run.collect()
    finally:
        run.close()
    final = results[0][-1]
    return final if isinstance(final, list) else [final]


def _encode(state: ServerState):
    return state.engine.async_encode


def _usage_and_model(state: ServerState, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": state.served_model_name, "usage": pooling.usage(results)}


async def _answer(work) -> Response:
    """The route's JSON, or 400 for a request the pooling layer refuses, 499 when the client left."""
    try:
        return json_response(await work)
    except RequestFieldError as error:
        raise bad_request(str(error), param=error.field) from None
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


@router.post("/v1/embeddings")
async def embeddings(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body = parse_request(EmbeddingRequest, await request.body())
    lora = check_model(state, body.model)

    async def work() -> dict[str, Any]:
        prompts = pooling.as_prompts(body.input, "input")
        results = await _run(request, tenant, pooling.embed_request(state.model_info, prompts, lora_path=lora,
                                                                    cache_salt=body.cache_salt))
        data = []
        for index, result in enumerate(results):
            vector = pooling.truncate_embedding(result["embedding"], body.dimensions)
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": vector})
        return {"object": "list", "data": data, **_usage_and_model(state, results)}

    return await _answer(work())


async def rerank(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body = parse_request(RerankRequest, await request.body())
    lora = check_model(state, body.model)

    async def work() -> dict[str, Any]:
        generate = await pooling.rerank_request(state.model_info, body.query, body.documents, _encode(state),
                                                lora_path=lora)
        results = await _run(request, tenant, generate)
        scores = pooling.relevance_scores(state.model_info, [r["embedding"] for r in results])
        ranked = pooling.rank_documents(scores, body.documents, body.top_n, body.return_documents)
        return {"id": f"rerank-{uuid.uuid4().hex}", "results": ranked, **_usage_and_model(state, results)}

    return await _answer(work())


router.add_api_route("/v1/rerank", rerank, methods=["POST"])
router.add_api_route("/rerank", rerank, methods=["POST"])


@router.post("/v1/score")
async def score(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body = parse_request(ScoreRequest, await request.body())
    lora = check_model(state, body.model)
    items = [body.items] if isinstance(body.items, str) or (body.items and isinstance(body.items[0], int)) \
        else body.items

    async def work() -> dict[str, Any]:
        generate = await pooling.score_request(body.query, items, body.label_token_ids, body.item_first,
                                               _encode(state), lora_path=lora)
        results = await _run(request, tenant, generate)
        scores = [pooling.label_probabilities(r["embedding"], body.apply_softmax) for r in results]
        return {"object": "scoring", "scores": scores, "created": int(time.time()), **_usage_and_model(state, results)}

    return await _answer(work())


async def classify(request: Request, tenant: Optional[str] = Depends(caller_tenant)) -> Response:
    state = _state(request)
    body = parse_request(ClassifyRequest, await request.body())
    lora = check_model(state, body.model)

    async def work() -> dict[str, Any]:
        prompts = pooling.as_prompts(body.input, "input")
        results = await _run(request, tenant, pooling.classify_request(prompts, lora_path=lora))
        data = pooling.classify_results(state.model_info, [r["embedding"] for r in results])
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "data": data,
                **_usage_and_model(state, results)}

    return await _answer(work())


router.add_api_route("/classify", classify, methods=["POST"])
router.add_api_route("/v1/classify", classify, methods=["POST"])
