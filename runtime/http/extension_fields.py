"""Request fields of SGLang's and vLLM's servers that radixserve does not implement.

Their clients send many of them always, at their default (SGLang's bench_serving sends `lora_path: null` and
`return_routed_experts: false` on every native request), so a request carrying one is accepted when the value
asks for nothing (null, false, 0, "", an empty list or object, or a list of those, one per prompt) and refused
with a 400 naming the feature otherwise. A few fields only label the request for logs and tracing; they never
change what is generated and are accepted with any value. The fields radixserve does implement are part of the
request models themselves (native_api.py, openai/protocol.py); a field that neither SGLang nor vLLM knows stays
a 400 there ("extra fields not permitted").
"""

from __future__ import annotations

from typing import Any

from radixserve.runtime.http.errors import APIError, bad_request

_MULTIMODAL = "multimodal input (this server runs text-only models)"
_DISAGGREGATION = "prefill-decode disaggregation"
_DATA_PARALLEL = "data-parallel routing"

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
    "custom_logit_processor": "custom logit processors",
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

# Fields that label a request (logging, metrics, tracing, routing hints among replicas): any value is accepted.
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
    "custom_logit_processor": "custom logit processors", "custom_params": "custom logit processors",
    "logits_processors": "custom logit processors",
    "bootstrap_host": _DISAGGREGATION, "bootstrap_port": _DISAGGREGATION, "bootstrap_room": _DISAGGREGATION,
    "kv_transfer_params": _DISAGGREGATION,
    "no_stop_trim": "keeping the stop string in the output",
    "include_stop_str_in_output": "keeping the stop string in the output",
    "stop_regex": "stop regexes",
    "structural_tag": "structural tags",
    "guided_json": "vLLM's guided decoding (use response_format, regex or ebnf)",
    "guided_regex": "vLLM's guided decoding (use response_format, regex or ebnf)",
    "guided_choice": "vLLM's guided decoding (use response_format, regex or ebnf)",
    "guided_grammar": "vLLM's guided decoding (use response_format, regex or ebnf)",
    "guided_decoding_backend": "vLLM's guided decoding (use response_format, regex or ebnf)",
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


def is_default(value: Any) -> bool:
    """Whether a value asks for nothing: null, false, 0, "", [] / {}, or a list (one per prompt) of those."""
    if value is None or value is False or value == "":
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, dict):
        return not value
    if isinstance(value, list):
        return all(is_default(item) for item in value)
    return False


def absorb(body: Any, unsupported: dict[str, str], labels: frozenset[str], where: str = "") -> Any:
    """`body` (a parsed JSON object) without the known foreign fields; an APIError (400) for one whose value asks
    for a feature this server lacks. Anything else (other fields, a body that is not an object) is left for the
    request model to judge."""
    if not isinstance(body, dict):
        return body
    kept = {}
    for name, value in body.items():
        if name in labels:
            continue
        if name in unsupported:
            if not is_default(value):
                raise _unsupported(where + name, unsupported[name])
            continue
        kept[name] = value
    return kept


def _unsupported(param: str, feature: str) -> APIError:
    return bad_request(f"{param}: this server does not support {feature}; leave {param} out or null",
                       param=param, code="unsupported_feature")
