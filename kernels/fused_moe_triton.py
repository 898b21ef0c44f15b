"""The routed experts of a mixture-of-experts layer on the GPU: Triton kernels over the (token, expert) pairs.

Every (token, slot) pair of the routing, `p = t * top_k + j`, is one row. `fused_moe` runs one of two paths, chosen
by the pair count alone (`use_decode_path`), so a CUDA graph captured for T tokens always replays the same one.

The aligned path (prefill sizes). `align_by_expert` sorts the pairs by expert and pads each expert's run to a multiple
of `BLOCK_M`, so that every block of `BLOCK_M` sorted rows belongs to one expert (`block_expert`; -1 for the blocks
past the last run). Then:

1. `_gate_up_kernel`: per block of rows and `BLOCK_N` intermediate columns, the rows' tokens times the expert's gate
   and up rows (two accumulators over the hidden dimension), `silu(gate) * up` in float32 (gpt-oss: biases added and
   its clamped SwiGLU instead), stored as the pair's row of the intermediate activations `[T * top_k, I]`;
2. `_down_kernel`: per block of rows and `BLOCK_N` hidden columns, those activations times the expert's down
   projection, scaled by the pair's routing weight, stored as the pair's row of `[T * top_k, H]`;
3. the sum over each token's `top_k` rows (one torch reduction, in float32).

Padding rows carry the sentinel pair `T * top_k`: they load zeros and store nothing. Every shape the launch uses
depends only on `(T, top_k, E, BLOCK_M)`, with no host synchronization, so the whole call can be captured in a CUDA
graph. Block sizes come from the per-shape table in kernels/fused_moe_configs.py. float32 inputs multiply in IEEE
float32 (no TF32), so a float32 model on the GPU keeps its precision.

The decode path (a few pairs; kernels/fused_moe_decode.py) reads each pair's expert straight from `topk_ids`, with no
sorting or padding, and runs matrix-vector products on the CUDA cores.

The aligned path reads an expert's weights once per `BLOCK_M` rows of its run; the decode path once per pair. Pairs
of one token visit distinct experts, so at one token nothing is read twice; with more tokens, experts repeat and the
decode path rereads them (from L2 where they still are). A pair of routing weight 0 contributes nothing and the
decode path skips it without reading its expert (expert parallelism routes other ranks' pairs so).

FP8 experts (float8_e4m3fn weights with block scales, `ExpertScales`) run on both paths with the scales applied in
registers (kernels/fused_moe_experts.py says how).

If the decode kernels fail to compile on a device (met in the warm-up, before any CUDA graph is captured), `fused_moe`
logs the reason once and the aligned path serves every later call.

Without CUDA the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before `triton` is
imported).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.fused_moe_configs import BlockConfig, block_config, decode_config
from radixserve.kernels.fused_moe_experts import (ExpertScales, _activate, _packed_tile, _scale_values, expert_call,
                                                  expert_layout, packed, reduced_tile, weight_strides)
from radixserve.kernels.fused_moe_decode import decode as _decode
from radixserve.kernels.guard import KernelGuard


class ExpertAlignment(NamedTuple):
    """Pairs sorted by expert in runs padded to `block_m` rows (see the module docstring)."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: pair index, or num_pairs for padding
    block_expert: torch.Tensor  # [num_blocks] int32: the expert of each block, -1 past the last run
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort the pairs of `topk_ids [T, k]` by expert, each expert's run padded to a multiple of `block_m`.

    The buffers take the most blocks any routing can need, `ceil((T*k + E*(block_m - 1)) / block_m)`, so their
    shapes do not depend on the routing.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat.index_select(0, order)
    rank_in_run = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts).index_select(0, experts_in_order)
    destination = (padded_end - padded).index_select(0, experts_in_order) + rank_in_run
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertAlignment(sorted_pairs, block_expert, block_m)


@triton.jit
def _gate_up_kernel(
    X, W13, B13, S13, Z13, Inter, SortedPairs, BlockExpert,
    num_pairs, top_k, hidden, intermediate, swiglu_alpha, swiglu_limit, up_scale_row,
    stride_x, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn, stride_sk, stride_inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, INT4: tl.constexpr, FP4: tl.constexpr,
):
    """Program (block of sorted rows, block of intermediate columns). With HAS_BIAS, the expert's gate and up biases
    (`B13 [E, 2I]`) join the accumulators; CLAMPED_SWIGLU applies gpt-oss's activation in place of SiLU; with
    HAS_SCALE, each tile's product with the quantized rows is scaled by their scales (`S13`) as it joins, after the
    zero points' share (`Z13`) is taken off for 4-bit integer rows (INT4; FP4: MXFP4's, which have none)."""
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(SortedPairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < intermediate
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_x + ks[None, :]
    gate_rows = W13 + expert * stride_we + cols[None, :] * stride_wn
    gate_ptrs = gate_rows + ks[:, None] * stride_wk
    up_ptrs = gate_ptrs + intermediate * stride_wn
    gate_scales = expert * stride_se + (cols // SCALE_N) * stride_sn
    up_scales = gate_scales + up_scale_row * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + ks < hidden
        x = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if HAS_SCALE:
            scale_k = (k0 // SCALE_K) * stride_sk
            gate_scale = _scale_values(tl.load(S13 + gate_scales + scale_k, mask=col_ok, other=0), FP4)
            up_scale = _scale_values(tl.load(S13 + up_scales + scale_k, mask=col_ok, other=0), FP4)
            if INT4:
                words = hidden // 8
                w_gate = _packed_tile(gate_rows, k0 // 8, words, stride_wk, col_ok, BLOCK_K, BLOCK_N, FP4)
                w_up = _packed_tile(gate_rows + intermediate * stride_wn, k0 // 8, words, stride_wk, col_ok, BLOCK_K,
                                    BLOCK_N, FP4)
                w_gate, w_up = w_gate.to(X.dtype.element_ty), w_up.to(X.dtype.element_ty)
                gate_part = tl.dot(x, w_gate, input_precision=PRECISION)
                up_part = tl.dot(x, w_up, input_precision=PRECISION)
                if not FP4:
                    x_sum = tl.sum(x.to(tl.float32), axis=1)[:, None]
                    gate_part -= x_sum * tl.load(Z13 + gate_scales + scale_k, mask=col_ok, other=0.0).to(
                        tl.float32)[None, :]
                    up_part -= x_sum * tl.load(Z13 + up_scales + scale_k, mask=col_ok, other=0.0).to(
                        tl.float32)[None, :]
            else:
                w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(X.dtype.element_ty)
                w_up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(X.dtype.element_ty)
                gate_part = tl.dot(x, w_gate, input_precision=PRECISION)
                up_part = tl.dot(x, w_up, input_precision=PRECISION)
            gate += gate_part * gate_scale[None, :]
            up += up_part * up_scale[None, :]
        else:
            gate = tl.dot(x, tl.load(gate_ptrs, mask=w_mask, other=0.0), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.load(up_ptrs, mask=w_mask, other=0.0), up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias_ptrs = B13 + expert * stride_be + cols
        gate += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptrs + intermediate, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    activated = _activate(gate, up, swiglu_alpha, swiglu_limit, CLAMPED_SWIGLU)
    out_ptrs = Inter + pairs[:, None].to(tl.int64) * stride_inter + cols[None, :]
    tl.store(out_ptrs, activated.to(Inter.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    Inter, W2, B2, S2, Z2, Out, PairWeights, SortedPairs, BlockExpert,
    num_pairs, hidden, intermediate,
    stride_inter, stride_we, stride_wn, stride_wk, stride_be, stride_se, stride_sn, stride_sk, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    INT4: tl.constexpr, FP4: tl.constexpr,
):
    """Program (block of sorted rows, block of hidden columns). With HAS_BIAS, the expert's down bias (`B2 [E, H]`)
    is added before the routing weight scales the row; with HAS_SCALE, the quantized rows' scales (`S2`) scale each
    tile's product, less the zero points' share (`Z2`) for 4-bit integer rows (INT4; FP4: MXFP4's, which have
    none)."""
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(SortedPairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = Inter + rows[:, None] * stride_inter + ks[None, :]
    w_rows = W2 + expert * stride_we + cols[None, :] * stride_wn
    w_ptrs = w_rows + ks[:, None] * stride_wk
    scales = expert * stride_se + (cols // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, intermediate, BLOCK_K):
        k_ok = k0 + ks < intermediate
        a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if HAS_SCALE:
            scale_at = scales + (k0 // SCALE_K) * stride_sk
            scale = _scale_values(tl.load(S2 + scale_at, mask=col_ok, other=0), FP4)
            if INT4:
                w = _packed_tile(w_rows, k0 // 8, intermediate // 8, stride_wk, col_ok, BLOCK_K, BLOCK_N, FP4)
                w = w.to(Inter.dtype.element_ty)
                part = tl.dot(a, w, input_precision=PRECISION)
                if not FP4:
                    a_sum = tl.sum(a.to(tl.float32), axis=1)[:, None]
                    part -= a_sum * tl.load(Z2 + scale_at, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            else:
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)
                part = tl.dot(a, w.to(Inter.dtype.element_ty), input_precision=PRECISION)
            acc += part * scale[None, :]
        else:
            acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(B2 + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(PairWeights + rows, mask=real, other=0.0)
    acc = acc * weight[:, None]
    tl.store(Out + rows[:, None] * stride_out + cols[None, :], acc.to(Out.dtype.element_ty),
             mask=real[:, None] & col_ok[None, :])


# Pipeline stages of the aligned path's kernels on 4-bit experts, whose weight tiles load as 32-bit words: with the
# tables' 4, Qwen3-30B-A3B's 512-token tiles (32 x 64, 128 deep) asked 254 KB of shared memory on an H100, which has
# 227 KB.
INT4_MAX_STAGES = 2
# The decode path runs up to this many (token, slot) pairs: 8 tokens of a top-8 model. Past it, the aligned path's
# tensor-core tiles start to pay for its sorting, and the rereads below grow. 0 turns the decode path off (benchmarks
# compare the two paths end to end that way).
DECODE_MAX_PAIRS = 64
# Off for the process once the decode kernels failed to compile here: the aligned path then serves every call.
_decode_guard = KernelGuard("the fused MoE's decode path", "the aligned path serves every token count")


def use_decode_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `fused_moe` takes the decode path for this call: up to `DECODE_MAX_PAIRS` pairs, and at most half as
    many pairs as experts unless there is one token (its pairs visit distinct experts). n pairs routed evenly over E
    experts visit about `E * (1 - exp(-n / E))` distinct ones; at `n = E / 2` that is 0.79 n, so the decode path reads
    at most about 1.27x the aligned path's expert bytes (Qwen3-30B-A3B, 128 experts, top-8: up to 8 tokens; Mixtral, 8
    experts, top-2: 1 and 2 tokens)."""
    num_pairs = num_tokens * top_k
    return _decode_guard.usable and num_pairs <= DECODE_MAX_PAIRS and (num_tokens == 1 or 2 * num_pairs <= num_experts)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: Optional[BlockConfig] = None, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, swiglu: Optional[tuple[float, float]] = None,
              path: Literal["auto", "aligned", "decode"] = "auto", w13_scales: Optional[ExpertScales] = None,
              w2_scales: Optional[ExpertScales] = None) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over each token's experts `e = topk_ids[t,
    j]`, as a new tensor `[T, H]` of hidden's dtype.

    `hidden [T, H]`; `w13 [E, 2I, H]` (each expert's gate rows, then its up rows); `w2 [E, H, I]`; `topk_weights
    [T, k]` (float32) and `topk_ids [T, k]`. gpt-oss's experts: `w13_bias [E, 2I]` and `w2_bias [E, H]` (both or
    neither) are added to their projections, and `swiglu = (alpha, limit)` replaces the SiLU gate by `gate *
    sigmoid(alpha * gate) * (up + 1)` with the gate clamped to at most `limit` and up to `[-limit, limit]`. Quantized
    experts: `w13` and `w2` in FP8 or packed 4 bits (integers or MXFP4) with `w13_scales` and `w2_scales` (both or
    neither; `ExpertScales` gives the layouts), the product of the dequantized weights.

    `path`: "auto" chooses by `use_decode_path`; "aligned" or "decode" forces one (benchmarks and tests compare them).
    `config`: the block sizes of the path that runs (default: kernels/fused_moe_configs.py's tables; the aligned
    path's keys are `BLOCK_M`, `BLOCK_N`, `BLOCK_K`, the decode path's `BLOCK_N`, `BLOCK_K`, `DOWN_BLOCK_N`,
    `DOWN_BLOCK_K`, both with `num_warps` and `num_stages`).
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate, _ = expert_layout(w13, w2, w2_scales)
    top_k = topk_ids.shape[1]
    if packed(w13_scales):  # 4 bits: [E, H / 8, 2I]
        assert w13.shape == (num_experts, hidden_size // 8, 2 * intermediate), (w13.shape, w2.shape, hidden.shape)
    else:
        assert w13.shape == (num_experts, 2 * intermediate, hidden_size), (w13.shape, w2.shape, hidden.shape)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k), (topk_weights.shape, topk_ids.shape)
    has_bias = w13_bias is not None
    assert (w2_bias is not None) == has_bias, "give both biases or neither"
    if has_bias:
        assert w13_bias.shape == (num_experts, 2 * intermediate) and w2_bias.shape == (num_experts, hidden_size)
        assert w13_bias.stride(-1) == 1 and w2_bias.stride(-1) == 1
    assert (w13_scales is None) == (w2_scales is None), "give both experts' scales or neither"
    chosen = path == "auto"
    if chosen:
        path = "decode" if use_decode_path(num_tokens, top_k, num_experts) else "aligned"
    elif path not in ("aligned", "decode"):
        raise ValueError(f"unknown fused MoE path {path!r}: 'auto', 'aligned' or 'decode'")
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    dtype_name = str(hidden.dtype).removeprefix("torch.")
    if path == "decode":
        config = config or decode_config(num_experts, intermediate, hidden_size, dtype_name)
    else:
        config = config or block_config(num_tokens, num_experts, intermediate, hidden_size, dtype_name)
    args = (hidden.contiguous(), w13, w2, topk_weights.reshape(-1).float().contiguous(),
            topk_ids.reshape(-1).contiguous(), w13_bias, w2_bias, swiglu, (w13_scales, w2_scales))
    if path == "aligned":
        _aligned(*args, config, out)
        return out
    try:
        _decode(*args, config, out)
    except Exception as exc:  # a Triton build or device that cannot compile the decode kernels
        if not chosen or not _decode_guard.absorb(exc):
            raise
        _aligned(*args, block_config(num_tokens, num_experts, intermediate, hidden_size, dtype_name), out)
    return out


def _aligned(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pair_weights: torch.Tensor,
             pair_ids: torch.Tensor, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
             swiglu: Optional[tuple[float, float]], scales: tuple[Optional[ExpertScales], Optional[ExpertScales]],
             config: BlockConfig, out: torch.Tensor) -> None:
    """The aligned path of `fused_moe` (module docstring) on `pair_weights`, `pair_ids` `[T * k]`, into `out`."""
    c = expert_call(hidden, w13, w2, pair_ids, w13_bias, swiglu, scales, config)
    w13_scales, w2_scales = scales
    (s13, z13, *s13_strides), (s2, z2, *s2_strides) = c.w13_scales, c.w2_scales
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    launch = c.launch
    if c.w13_consts["INT4"]:  # each 4-bit value arrives in its 32-bit word: twice a bf16 tile's shared memory a stage
        launch = dict(launch, num_stages=min(launch["num_stages"], INT4_MAX_STAGES))
    alignment = align_by_expert(pair_ids, c.num_experts, block_m)
    num_blocks = alignment.block_expert.numel()
    inter = torch.empty(c.num_pairs, c.intermediate, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(c.intermediate, block_n))](
        hidden, w13, w13_bias if c.has_bias else w13, s13, z13, inter, alignment.sorted_pairs, alignment.block_expert,
        c.num_pairs, c.top_k, c.hidden_size, c.intermediate, c.alpha, c.limit, c.up_scale_row,
        hidden.stride(0), *weight_strides(w13, w13_scales), w13_bias.stride(0) if c.has_bias else 0,
        *s13_strides, inter.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=reduced_tile(block_k, w13_scales, c.hidden_size),
        PRECISION=precision, HAS_BIAS=c.has_bias, CLAMPED_SWIGLU=swiglu is not None, **c.w13_consts, **launch,
    )
    pair_out = torch.empty(c.num_pairs, c.hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(c.hidden_size, block_n))](
        inter, w2, w2_bias if c.has_bias else w2, s2, z2, pair_out, pair_weights,
        alignment.sorted_pairs, alignment.block_expert, c.num_pairs, c.hidden_size, c.intermediate,
        inter.stride(0), *weight_strides(w2, w2_scales), w2_bias.stride(0) if c.has_bias else 0,
        *s2_strides, pair_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=reduced_tile(block_k, w2_scales, c.intermediate),
        PRECISION=precision, HAS_BIAS=c.has_bias, **c.w2_consts, **launch,
    )
    out.copy_(pair_out.view(c.num_tokens, c.top_k, c.hidden_size).sum(dim=1, dtype=torch.float32))
