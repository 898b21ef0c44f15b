"""The sparse feed-forward of a mixture-of-experts layer: router, routed experts, and an optional shared expert.

`FusedMoE` holds the routed experts stacked at load time, `w13_weight [E, 2I, H]` (each expert's gate rows, then its
up rows) and `w2_weight [E, H, I]` (gpt-oss: with biases and its clamped SwiGLU), and runs them all at once: the
fused Triton kernel on CUDA (`kernels/fused_moe_triton.py`), the grouped GEMMs on the CPU
(`model_runner/moe/grouped.py`).

Tensor parallelism splits every expert's intermediate dimension over the ranks as the dense MLP's is split: rank r
holds rows `[r*I/tp, (r+1)*I/tp)` of each expert's gate and up and the same columns of its down, so each rank's
experts give a partial sum over their slice of I, and one all-reduce per layer (after the shared expert's partial
sum is added) completes it. The router and the shared expert's gate are replicated.

Expert parallelism (`tp.ep_size > 1`, `parallel.ExpertShard`) gives each rank E/ep experts instead, whole when
`ep == tp`. The scheme is the simplest correct one: the hidden states are already replicated on every rank (the
attention's all-reduce made them so), each rank runs all tokens through its own experts (pairs routed to another
rank's experts are skipped) and the same one all-reduce per layer sums the ranks' partial outputs. Its traffic is
an all-reduce of `[T, H]` per layer, as under plain tensor parallelism; what it saves is weight memory and weight
reads (each rank reads E/ep experts, whole, instead of a slice of all E). The all-to-all variant (DeepEP's
dispatch and combine) would have each rank send each token only to the ranks of its top-k experts and receive
only its own rows back, about `k/ep` of the tokens per rank instead of all of them, which pays once attention is
data-parallel and the hidden states are no longer replicated.

Quantized experts: an FP8 checkpoint's experts (or a 16-bit one's under `--quantization fp8`) can stay in
float8_e4m3fn (`keep_fp8`), with float32 scales per block or per output row in `w13_weight_scale` / `w2_weight_scale`,
a 4-bit checkpoint's (AWQ, GPTQ without act-order, compressed-tensors W4A16) in packed 4 bits (`keep_int4`), with
scales and zero points per group, and an MXFP4 checkpoint's (gpt-oss) as its own e2m1 codes in the same packing with
an exponent byte per 32 (`keep_mxfp4`), for the fused kernel to multiply where it reads them (one byte, or about half
a byte, a value instead of two). The loader asks for it on CUDA; the CPU's grouped GEMMs take 16-bit weights, so there the
experts are dequantized at load.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from radixserve.model_runner.layer_configs import ExpertActivation, MoEConfig
from radixserve.model_runner.layers import silu_and_mul
from radixserve.model_runner.moe.grouped import SILU, SMALL_MAX_PAIRS, grouped_experts, runs_small
from radixserve.model_runner.moe.routing import add_norm_route_tokens, route_tokens
from radixserve.model_runner.parallel import ExpertShard, TPGroup, split_size
from radixserve.model_runner.quantization.fp8 import FP8_DTYPE
from radixserve.model_runner.quantization.mxfp4 import BLOCK_SIZE as MXFP4_BLOCK


class FusedMoE(nn.Module):
    """The routed experts of one layer that this rank holds (`shard`: which experts, which slice of each);
    `forward` gives this rank's partial output. `w13_weight [E_local, 2I_local, H]`, `w2_weight [E_local, H,
    I_local]`, local expert i being the model's expert `shard.first_expert + i`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup, bias: bool = False,
                 activation: ExpertActivation = SILU) -> None:
        super().__init__()
        if tp.ep_size == 1:  # the same message as the dense MLP's when the intermediate size does not divide
            split_size(intermediate_size, tp, "experts' intermediate size")
        self.shard = ExpertShard.of(num_experts, intermediate_size, tp)
        self.num_experts = num_experts
        local_experts, local = self.shard.num_local_experts, self.shard.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(local_experts, 2 * local, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(local_experts, hidden_size, local))
        self.activation = activation
        # gpt-oss's biases: gate/up's `[E_local, 2I_local]` (this rank's slice, as the weight rows); down's `[E_local,
        # H]` is added by the rank holding each expert's first slice only, as the all-reduce sums the slices.
        self.w13_bias: Optional[nn.Parameter] = None
        self.w2_bias: Optional[nn.Parameter] = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(local_experts, 2 * local))
            self.w2_bias = nn.Parameter(torch.empty(local_experts, hidden_size))
        # Quantized experts (`keep_fp8`, `keep_int4`): the scales (and 4-bit zero points), and the (rows, features)
        # each of their values covers in w13 and w2
        self.w13_weight_scale: Optional[nn.Parameter] = None
        self.w2_weight_scale: Optional[nn.Parameter] = None
        self.w13_weight_zeros: Optional[nn.Parameter] = None
        self.w2_weight_zeros: Optional[nn.Parameter] = None
        self.scale_blocks: Optional[tuple[tuple[int, int], tuple[int, int]]] = None
        self.mxfp4 = False  # `keep_mxfp4`: the packed codes are e2m1, the scales exponent bytes
        # CPU deterministic inference: every call on the C++ experts, whose sums do not depend on the batch
        # (model_runner/moe/grouped.py)
        self.batch_invariant = False

    def keep_fp8(self, block: Optional[tuple[int, int]]) -> bool:
        """Hold the experts in FP8 with a float32 scale per `block` (rows, features) of each expert's gate, up and
        down, or per output row where `block` is None (before the weights load). False, and nothing changed, where
        this rank's slice of the intermediate dimension (tensor parallelism) would cut a scale block."""
        shard, (local_experts, hidden, _) = self.shard, self.w2_weight.shape
        local, whole = shard.intermediate_size, shard.intermediate_size * shard.num_slices
        if block is not None and shard.num_slices > 1 and any(
                shard.intermediate_start % size or local % size for size in block):
            return False
        w13_block, w2_block = (block, block) if block is not None else ((1, hidden), (1, whole))
        empty = self._empty_like_weights
        self.w13_weight = empty(local_experts, 2 * local, hidden, dtype=FP8_DTYPE)
        self.w2_weight = empty(local_experts, hidden, local, dtype=FP8_DTYPE)
        self.w13_weight_scale = empty(local_experts, 2 * _blocks(local, w13_block[0]), _blocks(hidden, w13_block[1]),
                                      dtype=torch.float32)
        self.w2_weight_scale = empty(local_experts, _blocks(hidden, w2_block[0]), _blocks(local, w2_block[1]),
                                     dtype=torch.float32)
        self.scale_blocks = (w13_block, w2_block)
        return True

    def _empty_like_weights(self, *shape: int, dtype: torch.dtype) -> nn.Parameter:
        """A fresh parameter on the experts' device (meta before allocation), for `keep_fp8` / `keep_int4`."""
        return nn.Parameter(torch.empty(*shape, dtype=dtype, device=self.w2_weight.device), requires_grad=False)

    @property
    def is_int4(self) -> bool:
        return self.w13_weight_zeros is not None

    @property
    def is_packed(self) -> bool:
        """Whether the weights are 4-bit codes packed eight a word along the reduced features (`keep_int4`,
        `keep_mxfp4`)."""
        return self.is_int4 or self.mxfp4

    def keep_mxfp4(self) -> bool:
        """Hold the experts as MXFP4 (before the weights load): w13 `[E, H / 8, 2I]`, w2 `[E, I / 8, H]` int32, eight
        e2m1 codes a word along the reduced features (`Int4Weight`'s packing), and one e8m0 exponent byte per 32 of
        them and output column, `[E, K / 32, N]` uint8 (kernels/fused_moe_experts.py's `ExpertScales.fp4`). False, and
        nothing changed, where the reduced features are not whole blocks of 32 or this rank's slice of each expert's
        down would cut one."""
        shard, (local_experts, hidden, _) = self.shard, self.w2_weight.shape
        local = shard.intermediate_size
        if hidden % MXFP4_BLOCK or local % MXFP4_BLOCK or shard.intermediate_start % MXFP4_BLOCK:
            return False
        empty = self._empty_like_weights
        self.w13_weight = empty(local_experts, hidden // 8, 2 * local, dtype=torch.int32)
        self.w2_weight = empty(local_experts, local // 8, hidden, dtype=torch.int32)
        self.w13_weight_scale = empty(local_experts, hidden // MXFP4_BLOCK, 2 * local, dtype=torch.uint8)
        self.w2_weight_scale = empty(local_experts, local // MXFP4_BLOCK, hidden, dtype=torch.uint8)
        self.scale_blocks = ((1, MXFP4_BLOCK), (1, MXFP4_BLOCK))
        self.mxfp4 = True
        return True

    def keep_int4(self, group_size: int) -> bool:
        """Hold the experts in 4 bits, `Int4Weight`'s layout stacked (w13 `[E, H / 8, 2I]`, w2 `[E, I / 8, H]` int32;
        scales and zero points per group of `group_size` reduced features, `[E, groups, N]` in the model's dtype;
        `group_size` <= 0: one group per row), before the weights load. False, and nothing changed, where the reduced
        features do not pack in words or this rank's slice of each expert's down would cut a group."""
        shard, (local_experts, hidden, _) = self.shard, self.w2_weight.shape
        local, whole = shard.intermediate_size, shard.intermediate_size * shard.num_slices
        w13_group = group_size if 0 < group_size < hidden else hidden
        w2_group = group_size if 0 < group_size < whole else whole
        cuts_group = shard.num_slices > 1 and w2_group < whole and (shard.intermediate_start % w2_group or
                                                                    local % w2_group)
        if hidden % 8 or local % 8 or shard.intermediate_start % 8 or hidden % w13_group or cuts_group:
            return False
        dtype, empty = self.w2_weight.dtype, self._empty_like_weights
        self.w13_weight = empty(local_experts, hidden // 8, 2 * local, dtype=torch.int32)
        self.w2_weight = empty(local_experts, local // 8, hidden, dtype=torch.int32)
        self.w13_weight_scale = empty(local_experts, hidden // w13_group, 2 * local, dtype=dtype)
        self.w13_weight_zeros = empty(local_experts, hidden // w13_group, 2 * local, dtype=dtype)
        self.w2_weight_scale = empty(local_experts, _blocks(local, w2_group), hidden, dtype=dtype)
        self.w2_weight_zeros = empty(local_experts, _blocks(local, w2_group), hidden, dtype=dtype)
        self.scale_blocks = ((1, w13_group), (1, w2_group))
        return True

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """`hidden [T, H]`, `topk_weights [T, k]` float32, `topk_ids [T, k]` (the model's expert ids) -> `[T, H]` in
        hidden's dtype: the sum over the pairs whose expert this rank holds."""
        local_ids = topk_ids
        if self.shard.num_local_experts < self.num_experts:
            local_ids = topk_ids - self.shard.first_expert
            elsewhere = (local_ids < 0) | (local_ids >= self.shard.num_local_experts)
            local_ids = local_ids.masked_fill(elsewhere, self.shard.num_local_experts)
        if hidden.is_cuda or self.scale_blocks is not None:  # quantized experts run on the Triton kernels only
            # (CPU-only processes never import triton; a CPU test runs them under the Triton interpreter)
            from radixserve.kernels.fused_moe_triton import ExpertScales, fused_moe

            if local_ids is not topk_ids:
                # The fused kernels take ids in [0, E_local): another rank's pairs go to local expert 0 with weight
                # 0. The decode path skips pairs of weight 0 unread; the aligned path computes them (skipping them
                # there needs its alignment to drop an extra bucket, as the CPU path does).
                topk_weights = topk_weights.masked_fill(elsewhere, 0.0)
                local_ids = local_ids.masked_fill(elsewhere, 0)
            scales = {}
            if self.scale_blocks is not None:
                (w13_block, w2_block) = self.scale_blocks
                scales = {"w13_scales": ExpertScales(self.w13_weight_scale, *w13_block, self.w13_weight_zeros,
                                                     self.mxfp4),
                          "w2_scales": ExpertScales(self.w2_weight_scale, *w2_block, self.w2_weight_zeros,
                                                    self.mxfp4)}
            return fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, local_ids, w13_bias=self.w13_bias,
                             w2_bias=self.w2_bias, swiglu=self._swiglu_args(), **scales)
        return grouped_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, local_ids, self.w13_bias,
                               self.w2_bias, self.activation,
                               small_max_pairs=None if self.batch_invariant else SMALL_MAX_PAIRS)

    def _swiglu_args(self) -> Optional[tuple[float, float]]:
        """The fused kernel's clamped SwiGLU `(alpha, limit)`; None for SiLU."""
        if self.activation.kind == "silu":
            return None
        return self.activation.alpha, self.activation.limit

    def extra_repr(self) -> str:
        experts, rows, cols = self.w2_weight.shape
        hidden, local = (cols, rows * 8) if self.is_packed else (rows, cols)
        first = self.shard.first_expert
        form = "mxfp4" if self.mxfp4 else ("4-bit" if self.is_int4 else "fp8")
        quantized = "" if self.scale_blocks is None else (
            f", {form} scales per {self.scale_blocks[0]} / {self.scale_blocks[1]}")
        return (f"experts={first}..{first + experts - 1} of {self.num_experts}, hidden={hidden}, "
                f"intermediate_per_rank={local}{quantized}")


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense expert that every token passes through; `forward` gives this rank's partial output (the
    down projection is row-split and not reduced here: the MoE block reduces once for both)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        local = split_size(intermediate_size, tp, "shared expert's intermediate size")
        self.gate_up_proj = nn.Linear(hidden_size, 2 * local, bias=False)
        self.down_proj = nn.Linear(local, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Route each token to its top-k experts (the family's rule, `MoEConfig.routing`), sum their outputs by the
    routing weights, add the sigmoid-gated shared expert where the family has one, and all-reduce over TP ranks.

    Parameter names follow the Hugging Face checkpoints (`gate`, `experts`, `shared_expert`, `shared_expert_gate`);
    the model's loader stacks each expert's tensors into `experts.w13_weight` / `experts.w2_weight`.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = moe.top_k
        self.routing = moe.routing
        self.renormalize = moe.renormalize
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.bias)
        self.experts = FusedMoE(moe.num_experts, hidden_size, moe.intermediate_size, tp, moe.bias, moe.activation)
        self.shared_expert: Optional[SharedExpert] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, moe.shared_expert_intermediate_size, tp)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route_tokens(hidden, self.gate, self.top_k, self.routing, self.renormalize)
        return self._experts(hidden, topk_weights, topk_ids)

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor,
                           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """`(forward(hidden), residual)` for `hidden, residual = norm(x, residual)`; at a decode step's one token on
        CUDA the add and the norm run in the router's launch (`add_norm_route_tokens`)."""
        hidden, residual, topk_weights, topk_ids = add_norm_route_tokens(x, residual, norm, self.gate, self.top_k,
                                                                         self.routing, self.renormalize)
        return self._experts(hidden, topk_weights, topk_ids), residual

    def _experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.tp.all_reduce(out)


def use_batch_invariant_experts(model: nn.Module) -> None:
    """CPU deterministic inference: every `FusedMoE` of `model` runs each call on the C++ experts (whatever its pair
    count), whose sums do not depend on the batch. ValueError for experts that call cannot run (gpt-oss's biased,
    clamped ones), which the grouped GEMMs would make batch-dependent."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            if not runs_small(module.w13_weight, module.w13_bias, module.w2_bias, module.activation):
                raise ValueError("--enable-deterministic-inference on the CPU runs a mixture of experts' experts "
                                 "on a kernel for SiLU experts without biases in float32 or bfloat16; this model's "
                                 "experts are not, and their grouped GEMMs depend on the batch")
            module.batch_invariant = True
