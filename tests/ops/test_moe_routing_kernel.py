"""The routing kernel (kernels/moe_routing.py) against the torch form of each rule (`select_experts` on the CPU).

Without a GPU it runs under the Triton interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`). Logits are drawn
distinct within each row, so that the top-k is unique and the ids must match exactly; exact ties are checked on their
own against the kernel's documented rule (the lower expert id first). On a GPU, `select_experts` itself takes the
kernel: it is checked there against the torch form, in bfloat16 and inside a CUDA graph.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixserve.kernels.moe_routing import route_topk  # noqa: E402
from radixserve.model_runner.moe.routing import select_experts, select_experts_torch  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
RULES = [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", True)]


def distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Each row a permutation of `(i - E/2) / 16` for i < E: distinct and exact in bfloat16 as in float32 (up to 256
    experts), spread as router logits are, from -E/32 to E/32."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=generator) for _ in range(num_tokens)]
    logits = (torch.stack(rows).float() - num_experts / 2) / 16
    return logits.to(dtype)


@pytest.mark.parametrize("routing,renormalize", RULES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 60, 4), (3, 128, 8), (2, 8, 8), (4, 7, 1),
                                                          (2, 256, 8)])
def test_equals_the_torch_form(routing, renormalize, num_tokens, num_experts, top_k):
    """Random float32 logits (distinct: checked) and, separately, distinct bfloat16 ones."""
    generator = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    random_logits = torch.randn(num_tokens, num_experts, generator=generator)
    assert all(row.unique().numel() == num_experts for row in random_logits)
    for logits in (random_logits, distinct_logits(num_tokens, num_experts, torch.bfloat16)):
        weights, ids = route_topk(logits.to(DEVICE), top_k, routing, renormalize)
        expected_weights, expected_ids = select_experts(logits, top_k, routing, renormalize)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(ids.cpu(), expected_ids)
        torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-6, atol=1e-7)


def test_strided_logits_and_no_tokens():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    weights, ids = route_topk(logits[:, ::2].to(DEVICE), 3, "softmax_topk", True)
    expected_weights, expected_ids = select_experts(logits[:, ::2], 3, "softmax_topk", True)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-6, atol=1e-7)
    weights, ids = route_topk(torch.empty(0, 16, device=DEVICE), 2, "topk_softmax", True)
    assert weights.shape == ids.shape == (0, 2)


def test_exact_ties_take_the_lower_expert_first():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = route_topk(logits.to(DEVICE), 4, "topk_softmax", True)
    assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    assert torch.allclose(weights[1].cpu(), torch.full((4,), 0.25))


def test_bad_arguments_are_refused():
    logits = torch.randn(2, 8).to(DEVICE)
    with pytest.raises(ValueError, match="unknown MoE routing"):
        route_topk(logits, 2, "sigmoid", False)
    with pytest.raises(ValueError, match="top_k 9"):
        route_topk(logits, 9, "softmax_topk", False)
    with pytest.raises(ValueError, match="top_k 0"):
        route_topk(logits, 0, "softmax_topk", False)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("routing,renormalize", RULES)
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_select_experts_on_cuda_takes_the_kernel_in_a_cuda_graph(routing, renormalize, num_tokens):
    """Qwen3-30B-A3B's router (128 experts, top-8), bfloat16 logits, captured and replayed on new logits."""
    logits = distinct_logits(num_tokens, 128, torch.bfloat16).cuda()
    select_experts(logits, 8, routing, renormalize)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = select_experts(logits, 8, routing, renormalize)
    new_logits = distinct_logits(num_tokens, 128, torch.bfloat16, seed=5)
    logits.copy_(new_logits.cuda())
    graph.replay()
    for device in ("cpu", "cuda"):  # the torch form on either device
        expected_weights, expected_ids = select_experts_torch(new_logits.to(device), 8, routing, renormalize)
        assert torch.equal(ids.cpu(), expected_ids.cpu())
        torch.testing.assert_close(weights.cpu(), expected_weights.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("routing,renormalize", RULES)
@pytest.mark.parametrize("num_experts,hidden,top_k,bias", [(128, 512, 8, False), (32, 300, 4, True),
                                                            (60, 1000, 2, True), (8, 64, 8, False)])
def test_router_product_and_rule_in_one_launch(routing, renormalize, num_experts, hidden, top_k, bias):
    """`route_from_hidden` against the rule on the float64 product `hidden @ weight.T + bias` (distinct logits, so
    the ids must match), with K split over programs that end on a partial tile, and the shared counter left at
    zero."""
    from radixserve.kernels.moe_routing import FUSED_MAX_TOKENS, route_from_hidden
    from radixserve.kernels.split_k import split_counters

    num_tokens = FUSED_MAX_TOKENS
    generator = torch.Generator().manual_seed(num_experts * 7 + hidden)
    x = torch.randn(num_tokens, hidden, generator=generator)
    weight = torch.randn(num_experts, hidden, generator=generator) * hidden ** -0.5
    bias_tensor = torch.randn(num_experts, generator=generator) if bias else None
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x, weight = x.to(dtype), weight.to(dtype)
    logits = x.double() @ weight.double().T + (bias_tensor.double() if bias else 0)
    expected_weights, expected_ids = select_experts_torch(logits.float(), top_k, routing, renormalize)
    for block_e, block_k, splits in ((16, 64, 3), (32, 256, 8)):
        weights, ids = route_from_hidden(x.to(DEVICE), weight.to(DEVICE), None if bias_tensor is None else
                                         bias_tensor.to(DEVICE), top_k, routing, renormalize, block_e, block_k, splits)
        assert torch.equal(ids.cpu(), expected_ids)
        torch.testing.assert_close(weights.cpu(), expected_weights, atol=1e-5, rtol=1e-5)
    assert split_counters(x.device if not ON_GPU else torch.device("cuda"), 1)[0].item() == 0


def test_route_from_hidden_refuses_batches_beyond_decode():
    from radixserve.kernels.moe_routing import FUSED_MAX_TOKENS, route_from_hidden

    with pytest.raises(ValueError, match="tokens"):
        route_from_hidden(torch.zeros(FUSED_MAX_TOKENS + 1, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE),
                          None, 2, "softmax_topk", True)


@pytest.mark.parametrize("routing,renormalize", RULES)
@pytest.mark.parametrize("num_experts,hidden,top_k,bias", [(128, 2048, 8, False), (32, 2880, 4, True),
                                                           (60, 200, 4, False)])
def test_add_norm_route_is_the_norm_then_the_router(routing, renormalize, num_experts, hidden, top_k, bias):
    """`add_norm_route` against the torch form of `RMSNorm(x, residual)` (the roundings of models' norms) and the rule
    on the float64 product of its output, in bfloat16 (float16 under the interpreter, whose bfloat16 casts do not round
    as the GPU's do): the sum exactly, the normalized row to its last bit, the ids exactly."""
    from radixserve.kernels.moe_routing import FUSED_MAX_TOKENS, add_norm_route
    from radixserve.model_runner.layers import RMSNorm

    generator = torch.Generator().manual_seed(num_experts + hidden)
    x, residual = (torch.randn(FUSED_MAX_TOKENS, hidden, generator=generator) * scale for scale in (1.0, 4.0))
    weight = torch.randn(num_experts, hidden, generator=generator) * hidden ** -0.5
    bias_tensor = torch.randn(num_experts, generator=generator) if bias else None
    norm = RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=generator))
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    x, residual, weight, norm = x.to(dtype), residual.to(dtype), weight.to(dtype), norm.to(dtype)
    expected_hidden, expected_sum = norm(x, residual)  # the torch form, on the CPU
    logits = expected_hidden.double() @ weight.double().T + (bias_tensor.to(dtype).double() if bias else 0)
    expected_weights, expected_ids = select_experts_torch(logits.float(), top_k, routing, renormalize)
    weights, ids, normed, summed = add_norm_route(
        x.to(DEVICE), residual.to(DEVICE), norm.weight.detach().to(DEVICE), norm.eps, weight.to(DEVICE),
        None if bias_tensor is None else bias_tensor.to(dtype).to(DEVICE), top_k, routing, renormalize)
    assert torch.equal(summed.cpu(), expected_sum)
    torch.testing.assert_close(normed.cpu(), expected_hidden, atol=0, rtol=2 ** -8)
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, atol=2e-3, rtol=2e-3)
