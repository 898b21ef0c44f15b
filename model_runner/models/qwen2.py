"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (none on o_proj).

Sliding-window attention (`use_sliding_window`) is not implemented here; the runner caps the context length
at the window for such configs, where full attention and windowed attention coincide.
"""

from __future__ import annotations

from radixserve.model_runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    qkv_bias_override = True
    o_bias_override = False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen2DecoderLayer
