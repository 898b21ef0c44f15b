"""The fused MoE Triton kernels (kernels/fused_moe_triton.py), both paths, against a float64 reference.

Without a GPU they run under the Triton interpreter (tests/conftest.py sets `TRITON_INTERPRET=1` before anything
imports triton) at tiny shapes; on a GPU they are compiled and also checked in bfloat16 at Qwen3-30B-A3B's layer shape,
and inside a CUDA graph. The alignment of pairs to expert blocks is checked on its own. The decode path (no
alignment) is checked at 1 to 8 tokens, top-1 to top-8, with experts that several tokens of the batch share, with
and without gpt-oss's biases and clamped SwiGLU.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

from radixserve.kernels import fused_moe_configs, fused_moe_triton  # noqa: E402
from radixserve.kernels.fused_moe_triton import align_by_expert, fused_moe, use_decode_path  # noqa: E402
from radixserve.model_runner.moe.routing import select_experts  # noqa: E402
from test_moe_layer import (random_experts, random_gpt_oss_experts, reference_experts,  # noqa: E402
                            reference_gpt_oss_experts)

DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tl.zeros, InterpretedFunction) or isinstance(fused_moe_triton._down_kernel,
                                                                    InterpretedFunction), \
        "triton was imported before TRITON_INTERPRET=1 was set: the kernels would not run"


def routed(num_tokens: int, num_experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), top_k, "softmax_topk",
                                  True)
    return x, weights, ids


def test_alignment_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[3, 0], [0, 1], [3, 2], [3, 0]])
    alignment = align_by_expert(ids, 5, block_m=4)
    pairs, experts = alignment.sorted_pairs.tolist(), alignment.block_expert.tolist()
    assert len(pairs) == 4 * len(experts) and len(experts) == -(-(8 + 5 * 3) // 4)
    sentinel = 8
    # Expert 0: pairs 1, 2, 7; expert 1: 3; expert 2: 5; expert 3: 0, 4, 6; expert 4: none.
    assert pairs[:16] == [1, 2, 7, sentinel, 3, sentinel, sentinel, sentinel, 5, sentinel, sentinel, sentinel,
                          0, 4, 6, sentinel]
    assert experts[:4] == [0, 1, 2, 3] and set(experts[4:]) == {-1}
    assert set(pairs[16:]) == {sentinel}


CASES = [(1, 8, 2), (7, 8, 2), (33, 16, 4), (5, 64, 8)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k", CASES)
def test_fused_moe_equals_float64(num_tokens, num_experts, top_k):
    hidden, intermediate = 64, 48  # neither a multiple of every block size: the masks are exercised
    w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32)
    x, weights, ids = routed(num_tokens, num_experts, top_k, hidden, torch.float32, seed=num_tokens)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), config,
                    path="aligned")
    expected = reference_experts(x, w13, w2, weights, ids)
    error = ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert out.dtype == torch.float32 and error < 1e-5, error


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (21, 8, 4)])
def test_fused_moe_with_biases_and_clamped_swiglu_equals_float64(num_tokens, num_experts, top_k):
    """gpt-oss's experts: biases on gate/up and down, and the clamped SwiGLU (a limit low enough to clamp often)."""
    hidden, intermediate, alpha, limit = 64, 48, 1.702, 1.5
    w13, w2, w13_bias, w2_bias = random_gpt_oss_experts(num_experts, hidden, intermediate, torch.float32)
    x, weights, ids = routed(num_tokens, num_experts, top_k, hidden, torch.float32, seed=num_tokens)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), config,
                    w13_bias=w13_bias.to(DEVICE), w2_bias=w2_bias.to(DEVICE), swiglu=(alpha, limit), path="aligned")
    expected = reference_gpt_oss_experts(x, w13, w2, weights, ids, w13_bias, w2_bias, alpha, limit)
    error = ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert out.dtype == torch.float32 and error < 1e-5, error


def test_default_block_sizes_run_and_the_table_is_consulted():
    x, weights, ids = routed(3, 8, 2, 64, torch.float32)
    w13, w2 = random_experts(8, 64, 32, torch.float32)
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    expected = reference_experts(x, w13, w2, weights, ids)
    assert ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item() < 1e-5
    table = {(8, 32, 64, "float32"): [(2, {"BLOCK_M": 32}), (16, {"BLOCK_M": 64})]}
    assert fused_moe_configs.block_config(3, 8, 32, 64, "float32", table) == {"BLOCK_M": 64}
    assert fused_moe_configs.block_config(99, 8, 32, 64, "float32", table) == {"BLOCK_M": 64}
    assert fused_moe_configs.block_config(1, 8, 32, 64, "bfloat16", table)["BLOCK_M"] == 16  # the defaults


DECODE_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 16, "DOWN_BLOCK_N": 16, "DOWN_BLOCK_K": 16, "num_warps": 4, "num_stages": 2}


def routed_with_shared_experts(num_tokens: int, num_experts: int, top_k: int, hidden: int, seed: int):
    """`routed`, with the last token sent to the first token's experts in reverse slot order (other weights), so a
    batch of two or more tokens always has experts that several of its tokens visit."""
    x, weights, ids = routed(num_tokens, num_experts, top_k, hidden, torch.float32, seed=seed)
    if num_tokens > 1:
        ids[-1] = ids[0].flip(0)
    return x, weights, ids


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt_oss"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 8])
def test_decode_path_equals_float64(num_tokens, top_k, gpt_oss):
    """Hidden 40 and intermediate 24 are multiples of no block size but 8: every mask of both kernels is exercised."""
    hidden, intermediate, num_experts = 40, 24, 2 * top_k if top_k > 2 else 8
    x, weights, ids = routed_with_shared_experts(num_tokens, num_experts, top_k, hidden, seed=10 * num_tokens + top_k)
    on = {"path": "decode"}
    if gpt_oss:
        alpha, limit = 1.702, 1.5
        w13, w2, w13_bias, w2_bias = random_gpt_oss_experts(num_experts, hidden, intermediate, torch.float32)
        on.update(w13_bias=w13_bias.to(DEVICE), w2_bias=w2_bias.to(DEVICE), swiglu=(alpha, limit))
        expected = reference_gpt_oss_experts(x, w13, w2, weights, ids, w13_bias, w2_bias, alpha, limit)
    else:
        w13, w2 = random_experts(num_experts, hidden, intermediate, torch.float32)
        expected = reference_experts(x, w13, w2, weights, ids)
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), DECODE_CONFIG,
                    **on)
    error = ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert out.dtype == torch.float32 and out.shape == (num_tokens, hidden) and error < 1e-5, error


def test_decode_path_with_its_default_config_and_strided_routing():
    """The default decode config (blocks wider than these dimensions) on routing tensors that are column slices."""
    x, weights, ids = routed(2, 16, 2, 64, torch.float32, seed=3)
    w13, w2 = random_experts(16, 64, 32, torch.float32)
    wide_weights, wide_ids = torch.cat([weights, weights], dim=1), torch.cat([ids, ids], dim=1)
    out = fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), wide_weights[:, ::2].to(DEVICE),
                    wide_ids[:, ::2].to(DEVICE), path="decode")
    expected = reference_experts(x, w13, w2, wide_weights[:, ::2], wide_ids[:, ::2])
    assert ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_decode_path_skips_pairs_of_weight_zero_unread():
    """Expert parallelism sends other ranks' pairs to expert 0 with weight 0; here they go to an expert whose weights
    are NaN, which any read would spread into the output."""
    x, weights, ids = routed(3, 8, 2, 40, torch.float32, seed=4)
    w13, w2, w13_bias, w2_bias = random_gpt_oss_experts(8, 40, 24, torch.float32)
    ids, weights = ids.masked_fill(ids == 7, 6), weights.clone()
    ids[0, 1], ids[2, 0], weights[0, 1], weights[2, 0] = 7, 7, 0.0, 0.0
    unread = [t.clone() for t in (w13, w2, w13_bias, w2_bias)]
    for tensor in unread:
        tensor[7] = float("nan")
    out = fused_moe(*(t.to(DEVICE) for t in (x, unread[0], unread[1], weights, ids)), DECODE_CONFIG,
                    w13_bias=unread[2].to(DEVICE), w2_bias=unread[3].to(DEVICE), swiglu=(1.702, 1.5), path="decode")
    expected = reference_gpt_oss_experts(x, w13, w2, weights, ids, w13_bias, w2_bias, 1.702, 1.5)
    assert ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_path_choice_depends_on_the_pair_count_only():
    assert use_decode_path(1, 8, 8) and use_decode_path(1, 2, 2)  # one token: its experts are distinct
    assert use_decode_path(8, 8, 128) and not use_decode_path(9, 8, 128)  # Qwen3-30B-A3B: up to 64 pairs
    assert use_decode_path(2, 2, 8) and not use_decode_path(3, 2, 8)  # Mixtral: at most E / 2 pairs
    assert use_decode_path(64, 1, 256) and not use_decode_path(65, 1, 256)  # never past DECODE_MAX_PAIRS
    assert fused_moe_triton.DECODE_MAX_PAIRS == 64
    x, weights, ids = routed(1, 8, 2, 64, torch.float32)
    w13, w2 = random_experts(8, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="unknown fused MoE path"):
        fused_moe(x, w13, w2, weights, ids, path="gemv")


def test_a_decode_path_that_fails_to_compile_hands_over_to_the_aligned_path(monkeypatch, caplog):
    """A device whose Triton cannot build the decode kernels: the chosen call still answers (aligned), the reason is
    logged, and later calls choose the aligned path; a forced decode path raises."""
    x, weights, ids = (t.to(DEVICE) for t in routed(1, 8, 2, 64, torch.float32))
    w13, w2 = (w.to(DEVICE) for w in random_experts(8, 64, 32, torch.float32))
    expected = fused_moe(x, w13, w2, weights, ids, path="aligned")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(fused_moe_triton, "_decode", no_compiler)
    monkeypatch.setattr(fused_moe_triton._decode_guard, "usable", True)  # on again after the test
    with pytest.raises(RuntimeError, match="PTX"):
        fused_moe(x, w13, w2, weights, ids, path="decode")
    assert use_decode_path(1, 2, 8)
    with caplog.at_level("WARNING"):
        out = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, expected)
    assert "decode path failed" in caplog.text and "PTX assembly failed" in caplog.text
    assert not use_decode_path(1, 2, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens,path", [(1, "decode"), (8, "decode"), (1, "aligned"), (8, "aligned"),
                                             (64, "auto"), (512, "auto")])
def test_bfloat16_at_qwen3_30b_a3b_shape(num_tokens, path):
    """Experts of Qwen3-30B-A3B (128 x 768 x 2048, top-8), default block sizes, bfloat16 tolerances."""
    w13, w2 = random_experts(128, 2048, 768, torch.bfloat16)
    x, weights, ids = routed(num_tokens, 128, 8, 2048, torch.bfloat16)
    out = fused_moe(x.cuda(), w13.cuda(), w2.cuda(), weights.cuda(), ids.cuda(), path=path)
    expected = reference_experts(x, w13, w2, weights, ids)
    error = ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert out.dtype == torch.bfloat16 and error < 2e-2, error


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_decode_path_in_bfloat16_with_biases_and_clamped_swiglu(num_tokens):
    """gpt-oss-20b's expert shape (2880 x 2880, top-4; 8 of its 32 experts) on the decode path."""
    w13, w2, w13_bias, w2_bias = random_gpt_oss_experts(8, 2880, 2880, torch.bfloat16)
    x, weights, ids = routed(num_tokens, 8, 4, 2880, torch.bfloat16)
    out = fused_moe(x.cuda(), w13.cuda(), w2.cuda(), weights.cuda(), ids.cuda(), w13_bias=w13_bias.cuda(),
                    w2_bias=w2_bias.cuda(), swiglu=(1.702, 7.0), path="decode")
    expected = reference_gpt_oss_experts(x, w13, w2, weights, ids, w13_bias, w2_bias, 1.702, 7.0)
    error = ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert out.dtype == torch.bfloat16 and error < 2e-2, error


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["aligned", "decode"])
def test_replays_in_a_cuda_graph_with_new_routing(path):
    w13, w2 = random_experts(16, 256, 128, torch.bfloat16)
    w13, w2 = w13.cuda(), w2.cuda()
    x, weights, ids = (t.cuda() for t in routed(4, 16, 2, 256, torch.bfloat16))
    fused_moe(x, w13, w2, weights, ids, path=path)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids, path=path)
    new_x, new_weights, new_ids = routed(4, 16, 2, 256, torch.bfloat16, seed=9)
    x.copy_(new_x.cuda()), weights.copy_(new_weights.cuda()), ids.copy_(new_ids.cuda())
    graph.replay()
    expected = reference_experts(new_x, w13.cpu(), w2.cpu(), new_weights, new_ids)
    assert ((out.cpu().double() - expected).abs().max() / expected.abs().max()).item() < 2e-2
