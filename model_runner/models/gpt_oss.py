"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's decoder with attention sinks and biased, clamped-SwiGLU experts.

What differs from Llama (models/llama.py), as transformers' `GptOssForCausalLM` computes it:

- attention: biases on q/k/v and o; one learned sink logit per head that joins every softmax's denominator and
  carries no value (the attention backends take it as `sinks`, see attention/base.py); layers of `layer_types`
  "sliding_attention" attend within `sliding_window` (128), the others in full, alternately;
- RoPE with YaRN scaling (factor 32 over an original 4,096 positions; layers.py), its attention factor scaling cos/sin;
- every feed-forward is a mixture of experts: a router linear with bias, the top-k logits then a softmax over them, and
  experts with biases whose activation is the clamped SwiGLU `gate * sigmoid(1.702 * gate) * (up + 1)` (gate clamped
  to at most 7, up to [-7, 7]), through the shared MoE layer (model_runner/moe/).

The RMSNorm multiplies the normed value by the weight in float32 and rounds once, as transformers' gpt-oss norm does
(Llama's rounds the normed value to the activations' dtype first; the two differ in 16-bit models only).

Checkpoints store the experts stacked, `mlp.experts.gate_up_proj [E, H, 2I]` with gate and up interleaved (even columns
gate, odd columns up), `gate_up_proj_bias [E, 2I]` likewise, `down_proj [E, I, H]`, `down_proj_bias [E, H]`; the
released ones quantize both matrices as MXFP4 (`<name>_blocks` / `<name>_scales`, `quantization_config.quant_method`
"mxfp4", in the transposed `[E, out, in]` layout), dequantized here to the model's dtype at load
(quantization/mxfp4.py). The loader de-interleaves gate and up into `FusedMoE`'s `[gate rows | up rows]` and copies only
this rank's experts (expert parallelism) and slice of each (tensor parallelism).

On CUDA (`keep_experts_quantized`) an MXFP4 checkpoint's experts are held instead as the checkpoint's own codes and
exponents (`FusedMoE.keep_mxfp4`), which the fused MoE kernels decode in registers: about 0.53 bytes a value where
bf16 takes 2 (gpt-oss-20b's experts: about 10 GB instead of 39; gpt-oss-120b's about 61 GB, so it fits one 80 GB
card). `MXFP4_EXPERTS = "fp8"` holds them as FP8 with a float32 scale per block of 32 values of a row instead
(`FusedMoE.keep_fp8((1, 32))`, exactly the same values by `mxfp4_as_fp8`, 1.125 bytes a value). A 16-bit checkpoint or
random weights under an MXFP4 config are quantized into either layout (`quantize_mxfp4`, or FP8 per 32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch
from torch import nn

from radixserve.model_runner.layers import RMSNorm, RotaryEmbedding
from radixserve.model_runner.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from radixserve.model_runner.models.moe_base import rename_tensors, sparse_or_dense_mlp
from radixserve.model_runner.moe import FusedMoE
from radixserve.model_runner.parallel import TPGroup, full_shape
from radixserve.model_runner.quantization.fp8 import Fp8Weight
from radixserve.model_runner.quantization.mxfp4 import BLOCK_SIZE, dequantize_mxfp4, mxfp4_as_fp8, quantize_mxfp4

if TYPE_CHECKING:
    from radixserve.model_runner.model_config import ModelConfig

CHECKPOINT_RENAMES = ((".mlp.router.", ".mlp.gate."),)
_EXPERT_TENSOR = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_MXFP4_PART = re.compile(r"^(.+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
# How an MXFP4 checkpoint's experts are held where the fused kernels read them (CUDA): "mxfp4", its own codes and
# exponents, or "fp8", the same values in FP8 with a float32 scale per 32 (module docstring).
MXFP4_EXPERTS = "mxfp4"


class GptOssAttention(LlamaAttention):
    """Llama's attention (biases per `attention_bias`) with this rank's heads' sink logits."""

    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__(config, layer_id, rotary, tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def sink_logits(self) -> torch.Tensor:
        return self.sinks.float()


class GptOssRMSNorm(RMSNorm):
    """`(weight * x / rms(x))` in float32, rounded once to x's dtype; with a residual, `(norm(s), s)` for `s = x +
    residual`, as Llama's `RMSNorm`."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        summed = x if residual is None else residual + x
        x32 = summed.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * normed).to(summed.dtype)
        return out if residual is None else (out, summed)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention
    make_mlp = staticmethod(sparse_or_dense_mlp)

    def __init__(self, config: "ModelConfig", layer_id: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__(config, layer_id, rotary, tp)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Mxfp4Tensor:
    """A checkpoint tensor stored as MXFP4: its `_blocks` and `_scales` (tensors, or lazy safetensors slices)."""

    blocks: Any
    scales: Any

    def expert_codes(self, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `index`'s stored `(blocks [out, in/32, 16], scales [out, in/32])` uint8, on `device` (only its rows
        are read)."""
        return _take(self.blocks, index)[0].to(device), _take(self.scales, index)[0].to(device)

    def expert(self, index: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Expert `index`'s matrix `[out, in]`, dequantized on `device` (one expert at a time bounds the float copy)."""
        return dequantize_mxfp4(*self.expert_codes(index, device), dtype)

    def expert_fp8(self, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `index`'s matrix `[out, in]` as FP8 values and float32 scales per 32 (`mxfp4_as_fp8`), on `device`."""
        return mxfp4_as_fp8(*self.expert_codes(index, device))

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized tensor's `[E, out, in]`."""
        blocks = full_shape(self.blocks)
        return (*blocks[:-2], blocks[-2] * blocks[-1] * 2)


def pair_mxfp4_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors, each `<name>_blocks` / `<name>_scales` pair of the experts joined into one
    `(<name>, Mxfp4Tensor)` once both are read; ValueError if one of a pair is missing."""
    pending: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        match = _MXFP4_PART.match(name)
        if match is None:
            yield name, tensor
            continue
        parts = pending.setdefault(match.group(1), {})
        parts[match.group(2)] = tensor
        if len(parts) == 2:
            del pending[match.group(1)]
            yield match.group(1), Mxfp4Tensor(parts["blocks"], parts["scales"])
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {', '.join(sorted(pending))}")


def _take(tensor: Any, first: int, count: int = 1) -> torch.Tensor:
    """`tensor[first:first + count]` of a tensor or a lazy safetensors slice (only those rows are read)."""
    return tensor[first:first + count]


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's causal LM over gpt-oss's layers; its loader reads the stacked (16-bit or MXFP4) expert tensors and the
    `router` under the shared MoE block's name, `gate`."""

    layer_class = GptOssDecoderLayer

    def __init__(self, config: "ModelConfig", max_positions: Optional[int] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__(config, max_positions, tp)
        self.model.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        super().load_weights(pair_mxfp4_tensors(rename_tensors(weights, CHECKPOINT_RENAMES)), strict)

    def keep_experts_quantized(self, hf_config: dict) -> Optional[str]:
        """Before loading: hold an MXFP4 checkpoint's experts as MXFP4, or in FP8 with a scale per 32 values
        (`MXFP4_EXPERTS`, module docstring; FP8 too where this rank's slice of an expert is not whole blocks of 32
        for MXFP4's packing). How they are held, for the log (None: an unquantized checkpoint)."""
        if (hf_config.get("quantization_config") or {}).get("quant_method") != "mxfp4":
            return None
        experts = [module for module in self.modules() if isinstance(module, FusedMoE)]
        for module in experts:
            if not (MXFP4_EXPERTS == "mxfp4" and module.keep_mxfp4()):
                module.keep_fp8((1, BLOCK_SIZE))
        forms = sorted({"MXFP4" if m.mxfp4 else ("FP8" if m.scale_blocks else "the model's dtype") for m in experts})
        return f"MXFP4 experts held as {' and '.join(forms)} (a scale per 32 values)"

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int]]:
        # FP8 experts' scales load with their weights (`_copy_experts`)
        return {(name, shard) for name, shard in super()._expected_shards(params) if not name.endswith("_scale")}

    def _load_tensor(self, hf_name: str, tensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        match = _EXPERT_TENSOR.match(hf_name)
        if match is None:
            if isinstance(tensor, Mxfp4Tensor):
                raise ValueError(f"checkpoint tensor {hf_name!r} is MXFP4; only the experts may be")
            return super()._load_tensor(hf_name, tensor, params)
        prefix, projection, is_bias = match.group(1), match.group(2), match.group(3) is not None
        if f"{prefix}.w13_weight" not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
        experts: FusedMoE = self.get_submodule(prefix)
        target = f"{prefix}.{'w13' if projection == 'gate_up_proj' else 'w2'}_{'bias' if is_bias else 'weight'}"
        expected = self._checkpoint_shape(experts, projection, is_bias, isinstance(tensor, Mxfp4Tensor))
        found = tensor.shape if isinstance(tensor, Mxfp4Tensor) else full_shape(tensor)
        if tuple(found) != expected:
            raise ValueError(f"shape mismatch for {hf_name!r}: checkpoint {tuple(found)}, model expects {expected}")
        _copy_experts(experts, projection, is_bias, tensor, params[target].data)
        return target, -1

    def _checkpoint_shape(self, experts: FusedMoE, projection: str, is_bias: bool, mxfp4: bool) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape (MXFP4: dequantized, `[E, out, in]`)."""
        num_experts, hidden = experts.num_experts, self.config.hidden_size
        intermediate = experts.shard.intermediate_size * experts.shard.num_slices
        if projection == "gate_up_proj":
            if is_bias:
                return num_experts, 2 * intermediate
            return (num_experts, 2 * intermediate, hidden) if mxfp4 else (num_experts, hidden, 2 * intermediate)
        if is_bias:
            return num_experts, hidden
        return (num_experts, hidden, intermediate) if mxfp4 else (num_experts, intermediate, hidden)

    def _shard_of(self, hf_name: str, local_shape: tuple[int, ...]) -> Optional[tuple[int, int, int]]:
        if self.tp.size > 1 and hf_name.endswith(".self_attn.sinks"):
            heads = self.model.layers[0].self_attn.heads
            return 0, heads.q_start, heads.num_heads
        return super()._shard_of(hf_name, local_shape)


def _copy_experts(experts: FusedMoE, projection: str, is_bias: bool, tensor: Any, destination: torch.Tensor) -> None:
    """Copy this rank's experts (and slice of each) of one stacked checkpoint tensor into `destination`, the
    FusedMoE parameter: gate/up de-interleaved into `[gate rows | up rows]`, matrices into `[out, in]`. The down bias
    goes to the ranks that hold each expert's first slice, zero on the others (the all-reduce adds it once)."""
    shard = experts.shard
    first, start, local = shard.first_expert, shard.intermediate_start, shard.intermediate_size
    mine = slice(start, start + local)
    if is_bias:
        biases = _take(tensor, first, shard.num_local_experts).to(destination.dtype)
        if projection == "down_proj":
            destination.copy_(biases) if start == 0 else destination.zero_()
        else:
            destination[:, :local].copy_(biases[:, 0::2][:, mine])
            destination[:, local:].copy_(biases[:, 1::2][:, mine])
        return
    if experts.mxfp4:
        _copy_mxfp4_experts(experts, projection, tensor, destination)
        return
    if experts.scale_blocks is not None:
        _copy_fp8_experts(experts, projection, tensor, destination)
        return
    for index in range(shard.num_local_experts):
        if isinstance(tensor, Mxfp4Tensor):
            matrix = tensor.expert(first + index, destination.dtype, destination.device)  # [out, in]
        else:
            matrix = _take(tensor, first + index)[0].to(destination.dtype).t()  # [in, out] -> [out, in]
        _place(destination[index], projection, matrix, mine, mine)


def _place(destination: torch.Tensor, projection: str, matrix: torch.Tensor, rows: slice, columns: slice) -> None:
    """One expert's `[out, in]` matrix (or its scales) into its FusedMoE slot: down's `columns` of this rank's slice;
    gate/up's interleaved rows de-interleaved into `[gate rows | up rows]`, `rows` of each."""
    if projection == "down_proj":
        destination.copy_(matrix[:, columns])
    else:
        local = destination.shape[0] // 2
        destination[:local].copy_(matrix[0::2][rows])
        destination[local:].copy_(matrix[1::2][rows])


def _copy_mxfp4_experts(experts: FusedMoE, projection: str, tensor: Any, destination: torch.Tensor) -> None:
    """`_copy_experts` into MXFP4 experts (`FusedMoE.keep_mxfp4`): an MXFP4 tensor's codes and exponents as stored, a
    16-bit tensor quantized (`quantize_mxfp4`). A row's bytes read as little-endian 32-bit words hold eight codes
    each, the even-indexed value's in the low nibble: the packing the kernels read, transposed to `[in / 8, out]`."""
    shard = experts.shard
    first, start, local = shard.first_expert, shard.intermediate_start, shard.intermediate_size
    mine = slice(start, start + local)
    words, groups = slice(start // 8, (start + local) // 8), slice(start // BLOCK_SIZE, (start + local) // BLOCK_SIZE)
    scales = (experts.w2_weight_scale if projection == "down_proj" else experts.w13_weight_scale).data
    for index in range(shard.num_local_experts):
        if isinstance(tensor, Mxfp4Tensor):
            blocks, exponents = tensor.expert_codes(first + index, destination.device)  # [out, in/32, 16], [out, in/32]
        else:
            matrix16 = _take(tensor, first + index)[0].to(destination.device).t()  # [in, out] -> [out, in]
            blocks, exponents = quantize_mxfp4(matrix16)
        codes = blocks.reshape(blocks.shape[0], -1).contiguous().view(torch.int32)  # [out, in / 8]
        _place(destination[index].t(), projection, codes, mine, words)
        _place(scales[index].t(), projection, exponents, mine, groups)


def _copy_fp8_experts(experts: FusedMoE, projection: str, tensor: Any, destination: torch.Tensor) -> None:
    """`_copy_experts` into FP8 experts with a scale per 32 values of a row: MXFP4 rewritten exactly, a 16-bit
    tensor quantized per block of 32."""
    shard = experts.shard
    first, start, local = shard.first_expert, shard.intermediate_start, shard.intermediate_size
    mine = slice(start, start + local)
    scales = (experts.w2_weight_scale if projection == "down_proj" else experts.w13_weight_scale).data
    for index in range(shard.num_local_experts):
        if isinstance(tensor, Mxfp4Tensor):
            matrix, scale = tensor.expert_fp8(first + index, destination.device)  # [out, in], [out, in / 32]
        else:
            matrix16 = _take(tensor, first + index)[0].to(destination.device).float().t()  # [in, out] -> [out, in]
            quantized = Fp8Weight.quantize(matrix16, (1, BLOCK_SIZE))
            matrix, scale = quantized.weight, quantized.scale
        _place(destination[index], projection, matrix, mine, mine)
        _place(scales[index], projection, scale, mine, slice(start // BLOCK_SIZE, (start + local) // BLOCK_SIZE))
