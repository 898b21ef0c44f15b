"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) written from the format's definition, and small GGUF models in them.

gguf-py dequantizes these types but has no quantizer for them, so the packing is written here, straight from the
layout its dequantizers read (gguf/quants.py) with a plain min/max rounding instead of llama.cpp's search for the
best scales: the tests need real blocks, not llama.cpp's choice of them. gguf-py's own `dequantize` stays the
reference for what the blocks mean.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

SUPER_BLOCK = 256
KQUANT_TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


def _float16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator == 0, 0.0, numerator / denominator)


def _quantize_q45(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (5): per sub-block of 32, w = d * sc * q - dmin * m with 6-bit sc and m."""
    n = blocks.shape[0]
    top = (1 << bits) - 1
    sub = blocks.reshape(n, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - low) / top
    d = _float16(step.max(axis=-1) / 63)
    dmin = _float16(-low.min(axis=-1) / 63)
    sc = np.clip(np.rint(_divide(step, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(-low, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint(_divide(sub + offset, scale)), 0, top).astype(np.uint8).reshape(n, 256)

    packed_scales = np.empty((n, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed_scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # nibble byte 32j + i: value 64j + i low, value 64j + 32 + i high
    nibbles = ((pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed_scales]
    if bits == 5:  # bit s of fifth-bit byte i: bit 4 of value 32s + i
        fifth = (q.reshape(n, 8, 32) >> 4) & 1
        parts.append((fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
    return np.concatenate(parts + [nibbles], axis=1)


def _quantize_q6(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: per sub-block of 16, w = d * sc * (q - 32), int8 sc, q in 0..63."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16).astype(np.float32)
    step = np.abs(sub).max(axis=-1) / 31
    d = _float16(step.max(axis=-1) / 127)
    sc = np.clip(np.rint(_divide(step, d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
    scale = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_divide(sub, scale)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    # low nibbles: byte 64h + i holds value 128h + i (low half) and 128h + 64 + i (high half); high pairs: bits 2g of
    # byte 32h + i hold the top two bits of value 128h + 32g + i
    low = ((q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)).reshape(n, 128)
    top = (q.reshape(n, 2, 4, 32) >> 4) & 3
    high = (top << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2).astype(np.uint8)
    return np.concatenate([low, high.reshape(n, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)


def quantize_kquant(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """`values [rows, K]` (K a multiple of 256) -> the blocks `[rows, K / 256 * block bytes]` uint8."""
    rows, k = values.shape
    assert k % SUPER_BLOCK == 0, f"K-quants hold rows of whole super-blocks of {SUPER_BLOCK}, not {k}"
    blocks = values.reshape(-1, SUPER_BLOCK)
    if ggml_type == GGMLQuantizationType.Q6_K:
        packed = _quantize_q6(blocks)
    else:
        packed = _quantize_q45(blocks, 4 if ggml_type == GGMLQuantizationType.Q4_K else 5)
    return packed.reshape(rows, -1)


def _llama_cpp_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's Q/K rows in llama.cpp's order: per head, the two rotary halves interleaved row by row."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_llama_gguf(model_dir: str, path: str, tokenizer_gguf: str, layer_types: list[GGMLQuantizationType],
                     embedding_type: GGMLQuantizationType) -> None:
    """Write the Hugging Face llama model in `model_dir` (tied embeddings, K a multiple of 256) as a GGUF: layer i's
    projections in `layer_types[i]`, the embedding (also the LM head) in `embedding_type`, norms in float32, and
    `tokenizer_gguf`'s tokenizer (its vocabulary must be the model's)."""
    import json

    from safetensors.numpy import load_file

    config = json.load(open(f"{model_dir}/config.json"))
    tensors = load_file(f"{model_dir}/model.safetensors")
    writer = GGUFWriter(path, "llama")
    writer.add_name("tiny k-quant llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta")))
    writer.add_vocab_size(config["vocab_size"])
    for field in GGUFReader(tokenizer_gguf).fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)

    def add(name: str, values: np.ndarray, ggml_type: GGMLQuantizationType) -> None:
        writer.add_tensor(name, quantize_kquant(values.astype(np.float32), ggml_type), raw_dtype=ggml_type)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], embedding_type)
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"].astype(np.float32))
    for layer, ggml_type in enumerate(layer_types):
        for hf_name, gguf_name in _LAYER_TENSORS.items():
            values = tensors[f"model.layers.{layer}.{hf_name}.weight"]
            if values.ndim == 1:
                writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", values.astype(np.float32))
                continue
            if hf_name == "self_attn.q_proj":
                values = _llama_cpp_rows(values, config["num_attention_heads"])
            elif hf_name == "self_attn.k_proj":
                values = _llama_cpp_rows(values, config["num_key_value_heads"])
            add(f"blk.{layer}.{gguf_name}.weight", values, ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
