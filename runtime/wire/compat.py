"""SGLang's and vLLM's request fields: which radixserve honours, which only label a request, which it refuses.

Clients of those servers send many fields always, at their default (SGLang's bench_serving sends `lora_path: null`
and `return_routed_experts: false` on every native request), so a field radixserve does not implement is accepted
when its value asks for nothing (`asks_for_nothing`, the one rule) and refused with a message naming the feature
otherwise. A few fields only label a request for logs and tracing; they never change what is generated and are
accepted with any value. A field that neither SGLang nor vLLM knows is not in these tables: the request struct
refuses it as unknown.

- `NATIVE_UNSUPPORTED` / `NATIVE_LABELS`: native `/generate` (SGLang's GenerateReqInput fields);
- `OPENAI_UNSUPPORTED` / `OPENAI_LABELS`: the OpenAI routes (SGLang's and vLLM's extensions);
- `SAMPLING_UNSUPPORTED` / `SAMPLING_ALIASES`: SGLang's sampling parameters (`SamplingParams.from_request`).

The fields radixserve implements are declared by the request structs themselves (`request.py::GenerateRequest`,
the OpenAI models). SGLang's server flags have their own table (`sglang_flags.py`).
"""

from __future__ import annotations

from typing import Any

_MULTIMODAL = "multimodal input (this server runs text-only models)"
_DISAGGREGATION = "prefill-decode disaggregation"
_DATA_PARALLEL = "data-parallel routing"
_CUSTOM_LOGITS = "custom logit processors"
_STOP_STRING_KEPT = "keeping the stop string in the output"
_GUIDED = "vLLM's guided decoding (use structured_outputs, response_format, regex or ebnf)"

# SGLang's GenerateReqInput fields that native /generate does not implement -> the feature they ask for.
NATIVE_UNSUPPORTED: dict[str, str] = {
    "image_data": _MULTIMODAL, "video_data": _MULTIMODAL, "audio_data": _MULTIMODAL, "modalities": _MULTIMODAL,
    "mm_hashes": _MULTIMODAL, "mm_content_hashes": _MULTIMODAL, "use_audio_in_video": _MULTIMODAL,
    "video_config": _MULTIMODAL, "images_config": _MULTIMODAL, "max_dynamic_patch": _MULTIMODAL,
    "min_dynamic_patch": _MULTIMODAL, "image_max_dynamic_patch": _MULTIMODAL,
    "video_max_dynamic_patch": _MULTIMODAL,
    "input_embeds": "input embeddings instead of token ids",
    "positional_embed_overrides": "embedding overrides",
    "token_ids_logprob": "logprobs of chosen token ids (token_ids_logprob)",
    "return_sampling_mask": "sampling masks",
    "return_flat_raw_top_logprobs": "flat top-logprob arrays",
    "return_flat_raw_top_logprobs_b64": "flat top-logprob arrays",
    "return_hidden_states": "hidden states in the output",
    "return_routed_experts": "routed experts (a mixture-of-experts feature)",
    "routed_experts_start_len": "routed experts (a mixture-of-experts feature)",
    "return_indexer_topk": "sparse-attention indexer output",
    "return_entropy": "entropy in the output",
    "return_prompt_token_ids": "prompt token ids in the output",
    "return_bytes": "byte output",
    "session_params": "sessions (continual prompting)",
    "lora_id": "LoRA adapters by internal id (name the adapter in lora_path)",
    "custom_logit_processor": _CUSTOM_LOGITS,
    "bootstrap_host": _DISAGGREGATION, "bootstrap_port": _DISAGGREGATION, "bootstrap_room": _DISAGGREGATION,
    "bootstrap_pair_key": _DISAGGREGATION, "decode_tp_size": _DISAGGREGATION,
    "need_wait_for_mm_inputs": _DISAGGREGATION, "num_items_assigned": _DISAGGREGATION,
    "encoder_urls": _DISAGGREGATION,
    "disagg_prefill_dp_rank": _DATA_PARALLEL,
    "kv_router_hint": "external KV routing hints",
    "background": "background requests",
    "require_reasoning": "forced reasoning",
    "max_thinking_tokens": "thinking budgets",
    "extra_key": "extra cache keys (use cache_salt)",
    "multi_item_delimiter_indices": "multi-item scoring",
}

# Fields that label a native request (logging, metrics, tracing, routing hints among replicas): any value passes.
NATIVE_LABELS = frozenset({
    "log_metrics", "no_logs", "custom_labels", "external_trace_header", "received_time", "session_id",
    "conversation_id", "routing_key", "http_worker_ipc",
    # The model a gateway (sglang-router) routed by; /generate serves the one model it has.
    "model",
    # vLLM's and SGLang's streaming options; a native chunk's meta_info always carries the token counts.
    "stream_options",
})

# SGLang's and vLLM's OpenAI-route extensions that radixserve does not implement -> the feature they ask for.
OPENAI_UNSUPPORTED: dict[str, str] = {
    "session_params": "sessions (continual prompting)",
    "return_hidden_states": "hidden states in the output",
    "return_routed_experts": "routed experts (a mixture-of-experts feature)",
    "custom_logit_processor": _CUSTOM_LOGITS, "custom_params": _CUSTOM_LOGITS,
    "logits_processors": _CUSTOM_LOGITS,
    "bootstrap_host": _DISAGGREGATION, "bootstrap_port": _DISAGGREGATION, "bootstrap_room": _DISAGGREGATION,
    "kv_transfer_params": _DISAGGREGATION,
    "no_stop_trim": _STOP_STRING_KEPT,
    "include_stop_str_in_output": _STOP_STRING_KEPT,
    "stop_regex": "stop regexes",
    "structural_tag": "structural tags",
    "guided_json": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED,
    "use_beam_search": "beam search", "length_penalty": "beam search",
    "prompt_logprobs": "prompt logprobs on the OpenAI routes (use echo with logprobs, or /generate)",
    "allowed_token_ids": "allowed-token lists (use logit_bias)",
    "bad_words": "bad-word lists (use logit_bias)",
    "truncate_prompt_tokens": "prompt truncation",
    "return_tokens_as_token_ids": "token ids as logprob tokens",
    "reasoning_effort": "reasoning effort",
    "documents": "retrieval documents in the chat template",
    "mm_processor_kwargs": _MULTIMODAL,
    "top_n_sigma": "top-n-sigma sampling",
}

OPENAI_LABELS = frozenset({"rid", "request_id", "vllm_xargs", "return_text_in_logprobs"})

# SGLang's sampling parameters that radixserve does not implement -> (their own default, the feature they ask for).
SAMPLING_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "no_stop_trim": (False, _STOP_STRING_KEPT),
    "stop_regex": ([], "stop regexes"),
    "structural_tag": ("", "structural tags"),
    "custom_params": ({}, _CUSTOM_LOGITS),
    "stream_interval": (1, "a streaming interval other than every token"),
    "top_n_sigma": (0, "top-n-sigma sampling"),
}

# SGLang's other name of a sampling parameter here.
SAMPLING_ALIASES = {"sampling_seed": "seed"}


class UnsupportedFieldError(ValueError):
    """A request asks for a feature radixserve lacks; `field` names the field (its path in the request)."""

    def __init__(self, field: str, feature: str) -> None:
        super().__init__(f"{field}: this server does not support {feature}; leave {field} out or null")
        self.field = field


def asks_for_nothing(value: Any, default: Any = None) -> bool:
    """Whether a value asks for nothing: the field's own `default`, null, false, 0, "", an empty list or object,
    or a list (one per prompt) of those. The one rule for every foreign field, flag or parameter."""
    if value is None or value is False or value == "":
        return True
    if default is not None and value == default:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, dict):
        return not value
    if isinstance(value, list):
        return all(asks_for_nothing(item, default) for item in value)
    return False


def absorb(body: Any, unsupported: dict[str, str], labels: frozenset[str], where: str = "") -> Any:
    """`body` (a decoded JSON object) without the known foreign fields; UnsupportedFieldError for one whose value
    asks for a feature this server lacks. Anything else (other fields, a body that is not an object) is left for
    the request struct to judge."""
    if not isinstance(body, dict):
        return body
    kept = {}
    for name, value in body.items():
        if name in labels:
            continue
        if name in unsupported:
            if not asks_for_nothing(value):
                raise UnsupportedFieldError(where + name, unsupported[name])
            continue
        kept[name] = value
    return kept


def absorb_sampling(params: dict[str, Any]) -> None:
    """In place: SGLang's alias names become ours; its parameters without a feature here are dropped when they ask
    for nothing, refused (UnsupportedFieldError) otherwise."""
    for alias, name in SAMPLING_ALIASES.items():
        if alias in params:
            if name in params and params[name] != params[alias]:
                raise ValueError(f"give one of {name} and {alias} (SGLang's name of {name}), not both")
            params[name] = params.pop(alias)
    for name, (default, feature) in SAMPLING_UNSUPPORTED.items():
        if name in params and not asks_for_nothing(params.pop(name), default):
            raise UnsupportedFieldError(name, feature)

