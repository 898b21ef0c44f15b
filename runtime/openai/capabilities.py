"""Which optional engine features really work, found by asking the engine once.

Two OpenAI features depend on engine support that may be missing: prompt-token logprobs (`echo` with
`logprobs` on /v1/completions) and structured output (`response_format` json_object / json_schema). Rather
than return nulls or an aborted choice, the server probes the engine with one tiny request per feature
(during warm-up, or on first use) and answers 400 for a feature the engine does not deliver.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from radixserve.runtime.openai.errors import bad_request
from radixserve.tokenizer_manager.io import GenerateReqInput


@dataclass
class Capabilities:
    input_logprobs: bool
    structured_output: bool


async def _final(engine: Any, request: GenerateReqInput) -> dict[str, Any]:
    result: Any = None
    async for result in engine.generate_request(request):
        pass
    return result


async def probe(engine: Any, tokenizer: Any) -> Capabilities:
    prompt = list(tokenizer.encode("Hello, world")) or [0, 0]
    greedy_one = {"max_new_tokens": 1, "temperature": 0.0}
    logprobs_probe = GenerateReqInput(input_ids=prompt, sampling_params=greedy_one, return_logprob=True,
                                      logprob_start_len=0, rid=f"probe-logprobs-{uuid.uuid4().hex}")
    grammar_probe = GenerateReqInput(input_ids=prompt, rid=f"probe-grammar-{uuid.uuid4().hex}",
                                     sampling_params={**greedy_one, "json_schema": json.dumps({"type": "object"})})
    with_logprobs, with_grammar = await asyncio.gather(
        _final(engine, logprobs_probe), _final(engine, grammar_probe), return_exceptions=True)
    input_logprobs = False
    if isinstance(with_logprobs, dict):
        entries = with_logprobs["meta_info"].get("input_token_logprobs") or []
        input_logprobs = any(entry[0] is not None for entry in entries)
    structured = isinstance(with_grammar, dict) and (with_grammar["meta_info"].get("finish_reason") or {}).get(
        "type") != "abort"
    return Capabilities(input_logprobs=input_logprobs, structured_output=structured)


class CapabilityCheck:
    """The probe's result, computed once (at warm-up or on first need) and then reused."""

    def __init__(self) -> None:
        self._result: Optional[Capabilities] = None
        self._lock = asyncio.Lock()

    async def get(self, engine: Any, tokenizer: Any) -> Capabilities:
        async with self._lock:
            if self._result is None:
                self._result = await probe(engine, tokenizer)
            return self._result

    @property
    def known(self) -> Optional[Capabilities]:
        """The result if the probe already ran, else None."""
        return self._result

    async def require(self, engine: Any, tokenizer: Any, feature: str, param: str) -> None:
        """Raise a 400 naming `param` if the engine lacks `feature` ("input_logprobs" | "structured_output")."""
        capabilities = await self.get(engine, tokenizer)
        if not getattr(capabilities, feature):
            what = {"input_logprobs": "prompt-token logprobs (echo with logprobs)",
                    "structured_output": "structured output (response_format json_object / json_schema)"}[feature]
            raise bad_request(f"This server does not support {what} yet.", param=param)
