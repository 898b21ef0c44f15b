"""The public request object, and its split into single requests.

`GenerateReqInput` is what callers (the Engine, the HTTP server) hand to the TokenizerManager. It is either a
single request (`text` a str or `input_ids` a flat list of ints) or a batch (a list of those); the per-request
fields may be given once (broadcast to the whole batch) or as a list with one entry per prompt.
`split_requests` turns it into `SingleReq`s, one per prompt, still before `n` expansion.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from radixserve.runtime.wire.lora import namespace_part
from radixserve.runtime.wire.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    # SGLang-named dicts, or SamplingParams already built by SamplingParams.from_request (trusted as they are).
    sampling_params: Union[dict, SamplingParams, list[Union[dict, SamplingParams]], None] = None
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache_salt: Union[str, list[str], None] = None
    # SGLang's scheduling priority (used with --enable-priority-scheduling; scheduler/fair_share.py).
    priority: Union[int, list[Optional[int]], None] = None
    # SGLang's name: the LoRA adapter (its name) each prompt runs under; None: the base model.
    lora_path: Union[str, list[Optional[str]], None] = None
    # SGLang's: the data-parallel replica to run on (None: the controller's load-balance method decides).
    data_parallel_rank: Optional[int] = None
    # Set only by the HTTP server, from the API key; never taken from a client.
    tenant: Optional[str] = None
    tenant_weight: float = 1.0  # the tenant's fair-share weight (tenants file)
    # Set only by the servers' own routes: True streams new output only whatever the server's
    # incremental_streaming_output (the OpenAI routes build deltas); None follows that setting.
    incremental_stream: Optional[bool] = None

    @property
    def is_single(self) -> bool:
        """True for one prompt (a str, or a flat list of token ids)."""
        if self.text is not None:
            return isinstance(self.text, str)
        ids = self.input_ids
        return not (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)))


@dataclass
class SingleReq:
    """One prompt of a GenerateReqInput with its own fields (n not yet expanded)."""

    index: int  # position in the batch
    rid: str
    text: Optional[str]
    input_ids: Optional[tuple[int, ...]]  # a tuple: see split_requests
    sampling_params: Union[dict[str, Any], SamplingParams]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    cache_salt: Optional[str]
    priority: Optional[int] = None
    lora_name: Optional[str] = None

    def namespace(self, tenant: Optional[str]) -> tuple[str, ...]:
        """This prompt's radix-cache namespace: the one the scheduler caches it under and every router (the DP
        controller, the Ray proxy) routes it by."""
        return make_namespace(tenant, self.cache_salt, self.lora_name)


def make_namespace(tenant: Optional[str], cache_salt: Optional[str], lora_name: Optional[str] = None,
                   ) -> tuple[str, ...]:
    """The radix-cache namespace: ("tenant:<t>", "salt:<s>") with trailing empty parts dropped, then the LoRA
    adapter's part ("lora:<name>") when the request has one.

    The prefixes keep a tenant id, a salt and an adapter apart even when their strings are equal; no tenant, no
    salt and no adapter gives (), the default namespace.
    """
    parts = ["tenant:" + tenant if tenant else "", "salt:" + cache_salt if cache_salt else ""]
    while parts and parts[-1] == "":
        parts.pop()
    if lora_name:
        parts.append(namespace_part(lora_name))
    return tuple(parts)


def _per_request(name: str, value: Any, batch_size: int, is_item: Any) -> list[Any]:
    """Broadcast a single value, or check a per-request list has batch_size entries."""
    if isinstance(value, list) and not is_item(value):
        if len(value) != batch_size:
            raise ValueError(f"{name} has {len(value)} entries but the batch has {batch_size} prompts")
        return list(value)
    return [value] * batch_size


def _all_ints(values: Any) -> bool:
    """Whether every item is an int (bools are not): checked per distinct type, so a prompt of thousands of
    ids costs one pass in C."""
    return all(issubclass(kind, int) and kind is not bool for kind in set(map(type, values)))


def split_requests(obj: GenerateReqInput) -> list[SingleReq]:
    """Validate the shape of `obj` and return one SingleReq per prompt, in order.

    Raises ValueError when neither or both of text / input_ids are given, for an empty batch, or when a
    per-request list does not match the batch size.
    """
    if (obj.text is None) == (obj.input_ids is None):
        raise ValueError("give exactly one of text (prompt) or input_ids")
    if obj.text is not None:
        if isinstance(obj.text, str):
            texts: list[Optional[str]] = [obj.text]
        elif isinstance(obj.text, list) and all(isinstance(t, str) for t in obj.text):
            texts = list(obj.text)
        else:
            raise ValueError("text must be a string or a list of strings")
        ids: list[Optional[tuple[int, ...]]] = [None] * len(texts)
    else:
        if not isinstance(obj.input_ids, (list, tuple)):
            raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        batch_ids = [obj.input_ids] if obj.is_single else obj.input_ids
        for one in batch_ids:
            if not isinstance(one, (list, tuple)) or not _all_ints(one):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        # Prompts are kept as tuples of ints, which the cyclic garbage collector stops tracking after one pass:
        # a burst's prompts (millions of ids) would otherwise be walked by every full collection while it runs.
        ids = [tuple(one) for one in batch_ids]
        texts = [None] * len(ids)
    batch_size = len(texts)
    if batch_size == 0:
        raise ValueError("the batch is empty")

    def is_dict(value: Any) -> bool:
        return isinstance(value, (dict, SamplingParams))

    def never(value: Any) -> bool:
        return False

    params = _per_request("sampling_params", obj.sampling_params, batch_size, is_dict)
    rids = _per_request("rid", obj.rid, batch_size, never)
    return_logprob = _per_request("return_logprob", obj.return_logprob, batch_size, never)
    start_lens = _per_request("logprob_start_len", obj.logprob_start_len, batch_size, never)
    top_nums = _per_request("top_logprobs_num", obj.top_logprobs_num, batch_size, never)
    salts = _per_request("cache_salt", obj.cache_salt, batch_size, never)
    priorities = _per_request("priority", obj.priority, batch_size, never)
    loras = _per_request("lora_path", obj.lora_path, batch_size, never)
    if obj.rid is not None and not isinstance(obj.rid, list) and batch_size > 1:
        raise ValueError("a batch needs one rid per prompt (a list), not a single rid")

    requests = []
    for i in range(batch_size):
        sampling = params[i] if params[i] is not None else {}
        if not isinstance(sampling, (dict, SamplingParams)):
            raise ValueError(f"sampling_params must be a dict, got {type(sampling).__name__}")
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid must be a non-empty string, got {rid!r}")
        salt = salts[i]
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
        priority = priorities[i]
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        lora = loras[i]
        if lora is not None and not isinstance(lora, str):
            raise ValueError(f"lora_path must be an adapter's name (a string), got {type(lora).__name__}")
        requests.append(
            SingleReq(
                index=i,
                rid=rid,
                text=texts[i],
                input_ids=ids[i],
                sampling_params=sampling if isinstance(sampling, SamplingParams) else dict(sampling),
                return_logprob=bool(return_logprob[i]),
                logprob_start_len=-1 if start_lens[i] is None else int(start_lens[i]),
                top_logprobs_num=0 if top_nums[i] is None else int(top_nums[i]),
                cache_salt=salt or None,
                priority=priority,
                lora_name=lora or None,
            )
        )
    if len({r.rid for r in requests}) != len(requests):
        raise ValueError("rids in a batch must be distinct")
    return requests
