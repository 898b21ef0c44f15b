"""GenerateRequest, the one request every surface decodes into, and `normalize`, which decides once what follows
from it.

    request = GenerateRequest(text=["Hi", "Bye"], sampling_params={"n": 2, "seed": 7}, cache_salt="s")
    normalized = normalize(request, model_info)   # or ValueError, with `field` naming the field at fault

Native `/generate` decodes its JSON body with `request_body.decode_json`; each OpenAI route translates its body
with one function (runtime/http/openai/translate.py); `Engine.generate(prompt, sampling_params, **fields)` passes its
keywords as the fields. `normalize` is then the only place for:

- the batch shape: `text` or `input_ids`, one prompt or a list; per-prompt fields given once or one per prompt;
- `n` expansion: each prompt's samples, rid `{rid}-{i}` and seed `seed + i` (wrapped into 64 bits) when n > 1;
- sampling parameters: `SamplingParams.from_request` with the model's defaults (a SamplingParams the caller built
  with it is trusted as it is);
- the cache namespace (`make_namespace`: tenant, cache_salt, LoRA adapter), stored once in each prompt's
  `RequestOptions`, which the TokenizedGenerateReq carries to the DP controller and the scheduler. The Ray proxy
  routes by the same field; nobody builds a namespace again.

What only the tokenized prompt tells (the length rule, logprob_start_len within the prompt) and what changes at run
time (the loaded LoRA adapters, request ids in flight) the TokenizerManager checks. Light module: msgspec only.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta

from radixserve.runtime.wire.lora import namespace_part
from radixserve.runtime.wire.messages import ModelInfo, RequestOptions, SessionRetention
from radixserve.runtime.wire.pooling import PoolingParams
from radixserve.runtime.wire.sampling_params import INT64_MAX, INT64_MIN, InvalidSamplingParams, SamplingParams

MAX_BATCH = 1024  # prompts in one HTTP request
MAX_TOP_LOGPROBS = 20
MAX_RETENTION_SECONDS = 24 * 3600.0

TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Rid = Annotated[str, Meta(min_length=1, max_length=256)]
Salt = Annotated[str, Meta(max_length=256)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
LogprobStart = Annotated[int, Meta(ge=-1, le=2**31)]
Priority = Annotated[int, Meta(ge=-INT64_MAX, le=INT64_MAX)]
DpRank = Annotated[int, Meta(ge=0, le=1 << 16)]


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A generation request, in SGLang's names (native `/generate`'s JSON body, `Engine.generate`'s keywords).

    One prompt (`text` a string, or `input_ids` a flat list of ids) or a batch (a list of them). The per-prompt
    fields (PER_PROMPT_FIELDS) take one value for every prompt or a list with one per prompt. The annotations
    bound what a JSON body may hold (request_body.py); in-process callers are checked by `normalize`."""

    text: Union[str, Annotated[list[str], Meta(min_length=1, max_length=MAX_BATCH)], None] = None
    input_ids: Optional[Annotated[list[Union[TokenId, Annotated[list[TokenId], Meta(min_length=1)]]],
                                  Meta(min_length=1)]] = None
    # SGLang's sampling parameters (checked by SamplingParams.from_request), or in process a SamplingParams that
    # from_request built.
    sampling_params: Union[dict[str, Any], list[Optional[dict[str, Any]]], None] = None
    rid: Union[Rid, list[Rid], None] = None
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[LogprobStart, list[LogprobStart]] = -1
    top_logprobs_num: Union[TopLogprobs, list[TopLogprobs]] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache_salt: Union[Salt, list[Salt], None] = None
    priority: Union[Priority, list[Optional[Priority]], None] = None  # with --enable-priority-scheduling
    lora_path: Union[str, list[Optional[str]], None] = None  # SGLang's name: the LoRA adapter's name (None: base)
    # SGLang's two names for the data-parallel replica to run on (None: the controller decides).
    data_parallel_rank: Optional[DpRank] = None
    routed_dp_rank: Optional[DpRank] = None
    # Set by the server, never by a client (`request_body.decode_json` refuses them): the tenant of the API key and
    # its fair-share weight; True streams new output only, whatever --incremental-streaming-output says (the OpenAI
    # routes build deltas), None follows that setting.
    tenant: Optional[str] = None
    tenant_weight: float = 1.0
    incremental_stream: Optional[bool] = None
    # Set by the pooling surfaces (embeddings, rerank, score, classify; runtime/wire/pooling.py), never by a client of
    # /generate: every prompt prefills only and returns a vector. Its sampling_params must be left unset.
    pooling: Optional[PoolingParams] = None
    # A session whose prefix stays cached: `prompt_cache_retention` seconds after each request of the session
    # finishes, its prompt and output are kept from eviction (radix_cache/retention.py); the key alone asks nothing.
    prompt_cache_key: Optional[Annotated[str, Meta(min_length=1, max_length=256)]] = None
    prompt_cache_retention: Optional[Annotated[float, Meta(gt=0, le=MAX_RETENTION_SECONDS)]] = None

    @property
    def is_single(self) -> bool:
        """True for one prompt (a str, or a flat list of token ids)."""
        if self.text is not None:
            return isinstance(self.text, str)
        ids = self.input_ids
        return not (isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)))


PER_PROMPT_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                     "cache_salt", "priority", "lora_path")
SERVER_FIELDS = ("tenant", "tenant_weight", "incremental_stream", "pooling")


class RequestFieldError(ValueError):
    """A request the caller must fix; `field` names the field at fault (its path), None when no one field is."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


# ---- the cache namespace -------------------------------------------------------------------------------------


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


# ---- the batch shape -----------------------------------------------------------------------------------------


@dataclass
class PromptRequest:
    """One prompt of a GenerateRequest with its own fields, as given (sampling parameters not yet checked)."""

    index: int  # position in the batch
    rid: str
    text: Optional[str]
    input_ids: Optional[tuple[int, ...]]  # a tuple: see split_prompts
    sampling_params: Union[dict[str, Any], SamplingParams]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    cache_salt: Optional[str]
    priority: Optional[int] = None
    lora_name: Optional[str] = None

    def namespace(self, tenant: Optional[str]) -> tuple[str, ...]:
        """This prompt's radix-cache namespace (`normalize` stores it in the prompt's RequestOptions)."""
        return make_namespace(tenant, self.cache_salt, self.lora_name)


def _per_prompt(name: str, value: Any, batch_size: int, is_item: Any) -> list[Any]:
    """Broadcast a single value, or check a per-prompt list has batch_size entries."""
    if isinstance(value, list) and not is_item(value):
        if len(value) != batch_size:
            raise RequestFieldError(f"{name} has {len(value)} entries but the batch has {batch_size} prompts", name)
        return list(value)
    return [value] * batch_size


def _all_ints(values: Any) -> bool:
    """Whether every item is an int (bools are not): checked per distinct type, so a prompt of thousands of
    ids costs one pass in C."""
    return all(issubclass(kind, int) and kind is not bool for kind in set(map(type, values)))


def split_prompts(request: GenerateRequest) -> list[PromptRequest]:
    """The first step of `normalize`: check the shape of `request` and return one PromptRequest per prompt.

    Raises RequestFieldError when neither or both of text / input_ids are given, for an empty batch, or when a
    per-prompt list does not match the batch size.
    """
    if (request.text is None) == (request.input_ids is None):
        raise RequestFieldError("give exactly one of text (prompt) or input_ids")
    if request.text is not None:
        if isinstance(request.text, str):
            texts: list[Optional[str]] = [request.text]
        elif isinstance(request.text, list) and all(isinstance(t, str) for t in request.text):
            texts = list(request.text)
        else:
            raise RequestFieldError("text must be a string or a list of strings", "text")
        ids: list[Optional[tuple[int, ...]]] = [None] * len(texts)
    else:
        if not isinstance(request.input_ids, (list, tuple)):
            raise RequestFieldError("input_ids must be a list of ints or a list of lists of ints", "input_ids")
        batch_ids = [request.input_ids] if request.is_single else request.input_ids
        for one in batch_ids:
            if not isinstance(one, (list, tuple)) or not _all_ints(one):
                raise RequestFieldError("input_ids must be a list of ints or a list of lists of ints", "input_ids")
        # Prompts are kept as tuples of ints, which the cyclic garbage collector stops tracking after one pass:
        # a burst's prompts (millions of ids) would otherwise be walked by every full collection while it runs.
        ids = [tuple(one) for one in batch_ids]
        texts = [None] * len(ids)
    batch_size = len(texts)
    if batch_size == 0:
        raise RequestFieldError("the batch is empty")

    def is_sampling(value: Any) -> bool:
        return isinstance(value, (dict, SamplingParams))

    def never(value: Any) -> bool:
        return False

    values = {name: _per_prompt(name, getattr(request, name), batch_size, is_sampling if name == "sampling_params"
                                else never) for name in PER_PROMPT_FIELDS}
    if request.rid is not None and not isinstance(request.rid, list) and batch_size > 1:
        raise RequestFieldError("a batch needs one rid per prompt (a list), not a single rid", "rid")

    prompts = []
    for i in range(batch_size):
        sampling, rid, salt, priority, lora = (values[name][i] for name in (
            "sampling_params", "rid", "cache_salt", "priority", "lora_path"))
        sampling = {} if sampling is None else sampling
        if not isinstance(sampling, (dict, SamplingParams)):
            raise RequestFieldError(f"sampling_params must be a dict, got {type(sampling).__name__}",
                                    "sampling_params")
        rid = uuid.uuid4().hex if rid is None else rid
        if not isinstance(rid, str) or not rid:
            raise RequestFieldError(f"rid must be a non-empty string, got {rid!r}", "rid")
        if salt is not None and not isinstance(salt, str):
            raise RequestFieldError(f"cache_salt must be a string, got {type(salt).__name__}", "cache_salt")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise RequestFieldError(f"priority must be an integer, got {priority!r}", "priority")
        if lora is not None and not isinstance(lora, str):
            raise RequestFieldError(f"lora_path must be an adapter's name (a string), got {type(lora).__name__}",
                                    "lora_path")
        start_len, top_num = values["logprob_start_len"][i], values["top_logprobs_num"][i]
        prompts.append(PromptRequest(
            index=i,
            rid=rid,
            text=texts[i],
            input_ids=ids[i],
            sampling_params=sampling if isinstance(sampling, SamplingParams) else dict(sampling),
            return_logprob=bool(values["return_logprob"][i]),
            logprob_start_len=-1 if start_len is None else int(start_len),
            top_logprobs_num=0 if top_num is None else int(top_num),
            cache_salt=salt or None,
            priority=priority,
            lora_name=lora or None,
        ))
    if len({prompt.rid for prompt in prompts}) != len(prompts):
        raise RequestFieldError("rids in a batch must be distinct", "rid")
    return prompts


# ---- normalize -----------------------------------------------------------------------------------------------


class Sample(msgspec.Struct, frozen=True):
    """One of a prompt's n samples: its id (the caller sees it as meta_info's `id`) and its seed."""

    rid: str
    seed: Optional[int]


class NormalizedPrompt(msgspec.Struct, kw_only=True):
    """One prompt with everything decided but what its tokens tell (see the module docstring)."""

    index: int  # position in the batch
    rid: str  # the caller's (its samples' rids derive from it)
    text: Optional[str]
    input_ids: Optional[tuple[int, ...]]  # None until the TokenizerManager tokenizes `text`
    sampling_params: SamplingParams  # checked, the model's defaults filled in; `n` is len(samples)
    samples: list[Sample]
    options: RequestOptions

    def sample_params(self, sampling: SamplingParams, sample: Sample) -> SamplingParams:
        """A sample's own parameters: `sampling` (this prompt's, after the length rule) drawing once, its seed."""
        return msgspec.structs.replace(sampling, n=1, seed=sample.seed)


class NormalizedRequest(msgspec.Struct, kw_only=True):
    """A GenerateRequest after `normalize`: what the TokenizerManager sends, and routers read, as it is."""

    prompts: list[NormalizedPrompt]
    single: bool  # one prompt, given as a str or flat ids: its result is a dict, not a list
    stream: bool = False
    return_text_in_logprobs: bool = False
    incremental_stream: Optional[bool] = None
    tenant: Optional[str] = None
    routed_dp_rank: Optional[int] = None

    def sample_rids(self) -> dict[str, list[str]]:
        """Each prompt's rid -> the rids of its samples (what an abort of that rid reaches)."""
        return {prompt.rid: [sample.rid for sample in prompt.samples] for prompt in self.prompts}

    def per_sample(self) -> list["NormalizedRequest"]:
        """One single-prompt request per sample, prompt-major (prompt i's samples at i*n .. i*n+n-1)."""
        return [msgspec.structs.replace(self, single=True, prompts=[msgspec.structs.replace(
                    prompt, index=0, sampling_params=msgspec.structs.replace(prompt.sampling_params, n=1),
                    samples=[sample])])
                for prompt in self.prompts for sample in prompt.samples]


def sample_seed(seed: Optional[int], sample: int) -> Optional[int]:
    """Sample i of n draws with seed + i, so seeded samples differ yet repeat; wrapped to stay in 64 bits."""
    if seed is None or sample == 0:
        return seed
    seed += sample
    return INT64_MIN + (seed - INT64_MAX - 1) if seed > INT64_MAX else seed


def normalize(request: GenerateRequest, model: ModelInfo) -> NormalizedRequest:
    """Decide, once, everything that follows from `request` before its prompts are tokenized.

    Raises ValueError before anything is sent: RequestFieldError for the shape and the request-wide fields, and for
    a prompt's fields the error `located` (its `field` names the field; in a batch its message names the prompt)."""
    prompts = split_prompts(request)
    if request.pooling is not None:
        _check_pooling(request, prompts, model)
    elif not model.is_generation:
        raise RequestFieldError(f"this model does not generate text; it serves {', '.join(model.pooling_kinds)} "
                                "requests (/v1/embeddings, /v1/rerank, /classify)")
    _retention(request)  # a bad retention is the request's error, before any prompt's
    rank = request.data_parallel_rank if request.routed_dp_rank is None else request.routed_dp_rank
    if rank is not None and not 0 <= rank < model.dp_size:
        raise RequestFieldError(f"data_parallel_rank must be in [0, {model.dp_size}) (the server runs "
                                f"{model.dp_size} data-parallel replicas), got {rank}", "data_parallel_rank")
    return NormalizedRequest(
        prompts=[_normalize_prompt(prompt, request, model) for prompt in prompts],
        single=request.is_single,
        stream=bool(request.stream),
        return_text_in_logprobs=bool(request.return_text_in_logprobs),
        incremental_stream=request.incremental_stream,
        tenant=request.tenant,
        routed_dp_rank=rank,
    )


def _check_pooling(request: GenerateRequest, prompts: list[PromptRequest], model: ModelInfo) -> None:
    """A pooling request: the model serves its kind; it streams nothing, returns no logprobs and samples nothing
    (each prompt gets `max_new_tokens = 0`)."""
    try:
        request.pooling.check(model.vocab_size, model.pooling_kinds)
    except ValueError as error:
        raise RequestFieldError(str(error)) from None
    if request.stream:
        raise RequestFieldError("a pooling request cannot stream", "stream")
    for prompt in prompts:
        if prompt.sampling_params:
            raise RequestFieldError("a pooling request takes no sampling_params", "sampling_params")
        if prompt.return_logprob:
            raise RequestFieldError("a pooling request returns no logprobs", "return_logprob")
        prompt.sampling_params = {"max_new_tokens": 0}


def _retention(request: GenerateRequest) -> Optional[SessionRetention]:
    """The session retention the request asks for (prompt_cache_key with prompt_cache_retention), or None."""
    seconds = request.prompt_cache_retention
    if seconds is None:
        return None
    if request.prompt_cache_key is None:
        raise RequestFieldError("prompt_cache_retention keeps a session's prefix: give the session's "
                                "prompt_cache_key too", "prompt_cache_key")
    if not 0 < seconds <= MAX_RETENTION_SECONDS:
        raise RequestFieldError(f"prompt_cache_retention must be in (0, {MAX_RETENTION_SECONDS:.0f}] seconds, "
                                f"got {seconds}", "prompt_cache_retention")
    return SessionRetention(request.prompt_cache_key, float(seconds))


def _normalize_prompt(prompt: PromptRequest, request: GenerateRequest, model: ModelInfo) -> NormalizedPrompt:
    try:
        sampling = prompt.sampling_params
        if not isinstance(sampling, SamplingParams):
            sampling = SamplingParams.from_request(sampling, model.vocab_size, model.sampling_defaults)
        model.request_limits.check(sampling)
        if prompt.input_ids is not None:
            bad = [token for token in prompt.input_ids if not 0 <= token < model.vocab_size]
            if bad:
                raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {model.vocab_size}): "
                                 f"{bad[:5]}")
        if prompt.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {prompt.top_logprobs_num}")
    except ValueError as error:
        raise located(error, prompt.index, prompt.input_ids is not None, request.is_single) from None
    n = sampling.n
    samples = [Sample(prompt.rid if n == 1 else f"{prompt.rid}-{i}", sample_seed(sampling.seed, i)) for i in range(n)]
    options = RequestOptions(
        namespace=prompt.namespace(request.tenant),
        return_logprob=prompt.return_logprob,
        logprob_start_len=prompt.logprob_start_len,
        top_logprobs_num=prompt.top_logprobs_num,
        stream=bool(request.stream),
        priority=prompt.priority,
        tenant_weight=request.tenant_weight,
        lora_name=prompt.lora_name,
        pooling=request.pooling,
        retention=_retention(request),
    )
    return NormalizedPrompt(index=prompt.index, rid=prompt.rid, text=prompt.text, input_ids=prompt.input_ids,
                            sampling_params=sampling, samples=samples, options=options)


def located(error: ValueError, index: int, from_ids: bool, single: bool) -> ValueError:
    """The same error (same type: ContextLengthExceededError stays one) about prompt `index`, with `field` naming
    the request field at fault, `prompt` the prompt in a batch (None for a single prompt) and `reason` the bare
    message; in a batch the message names the prompt."""
    if isinstance(error, InvalidSamplingParams):
        field = "sampling_params" + (f".{error.field}" if error.field else "")
    else:
        field = "input_ids" if from_ids else "text"
    out = copy.copy(error)
    out.reason = str(error)  # type: ignore[attr-defined]
    out.prompt = None if single else index  # type: ignore[attr-defined]
    if not single:
        out.args = (f"prompt {index} of the batch: {error}",)
    out.field = field  # type: ignore[attr-defined]
    return out
