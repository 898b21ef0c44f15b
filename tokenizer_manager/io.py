"""The request's names as the TokenizerManager's callers have known them: `GenerateReqInput` is the wire's
`GenerateRequest` (runtime/wire/request.py), `SingleReq` one prompt of it, `split_requests` its batch shape."""

from __future__ import annotations

from radixserve.runtime.wire.request import GenerateRequest, PromptRequest, make_namespace, split_prompts

GenerateReqInput = GenerateRequest
SingleReq = PromptRequest
split_requests = split_prompts

__all__ = ["GenerateReqInput", "SingleReq", "make_namespace", "split_requests"]
