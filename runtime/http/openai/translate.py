"""The OpenAI routes' bodies as the wire's GenerateRequest: one translation per route.

The route checks what only the OpenAI protocol says (protocol.py), maps its sampling fields onto SGLang's
(`serving_common.sampling_params`), tokenizes the prompts, then hands the translation to `normalize`, which expands
`n` (one sample per choice: rid `{rid}-{i}`, seed `seed + i`) as it does for every surface. A field of these routes
that reaches the engine is read here and nowhere else on the way.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from radixserve.runtime.http.errors import from_value_error
from radixserve.runtime.http.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.runtime.wire.messages import ModelInfo
from radixserve.runtime.wire.request import GenerateRequest, NormalizedRequest, normalize
from radixserve.runtime.wire.sampling_params import SamplingParams


def completion_request(body: CompletionRequest, prompts: list[list[int]], sampling: SamplingParams,
                       response_id: str, lora_name: Optional[str], tenant: Optional[str],
                       tenant_weight: float) -> GenerateRequest:
    """`/v1/completions`: every prompt (token ids) with `n` samples each; prompt i's rid is `{response_id}-{i}`.
    `echo` with `logprobs` asks for the prompt tokens' logprobs too."""
    want_logprobs = body.logprobs is not None
    return GenerateRequest(
        input_ids=prompts,
        sampling_params=msgspec.structs.replace(sampling, n=body.n),
        rid=[f"{response_id}-{i}" for i in range(len(prompts))],
        return_logprob=want_logprobs,
        logprob_start_len=0 if (want_logprobs and body.echo) else -1,
        top_logprobs_num=body.logprobs or 0,
        **_common(body, lora_name, tenant, tenant_weight),
    )


def chat_request(body: ChatCompletionRequest, input_ids: list[int], sampling: SamplingParams, response_id: str,
                 lora_name: Optional[str], tenant: Optional[str], tenant_weight: float) -> GenerateRequest:
    """`/v1/chat/completions`: the rendered conversation with `n` samples; its rid is `response_id`."""
    return GenerateRequest(
        input_ids=input_ids,
        sampling_params=msgspec.structs.replace(sampling, n=body.n),
        rid=response_id,
        return_logprob=body.logprobs,
        top_logprobs_num=body.top_logprobs or 0,
        **_common(body, lora_name, tenant, tenant_weight),
    )


def _common(body: CompletionRequest | ChatCompletionRequest, lora_name: Optional[str], tenant: Optional[str],
            tenant_weight: float) -> dict[str, Any]:
    """The fields both routes translate alike. The routes build deltas, so they always stream new output only."""
    return {"stream": body.stream, "cache_salt": body.cache_salt, "priority": body.priority, "lora_path": lora_name,
            "data_parallel_rank": body.dp_rank, "tenant": tenant, "tenant_weight": tenant_weight,
            "incremental_stream": True}


def normalized(request: GenerateRequest, model_info: ModelInfo) -> NormalizedRequest:
    """`normalize`, with what it refuses as a 400 naming the field."""
    try:
        return normalize(request, model_info)
    except ValueError as error:
        raise from_value_error(error, param=getattr(error, "field", None)) from None
