"""The mixture-of-experts layer on the CPU: routing rules and the grouped experts against float64 references.

- Routing: each family's rule (softmax then top-k, renormalized or not; Mixtral's top-k then softmax) gives the
  experts and weights a float64 computation of the rule gives.
- The grouped experts (tokens sorted by expert, two grouped GEMMs) equal a float64 per-token sum over each token's
  experts, in float32 and bfloat16, with experts that no token visits and experts that every token visits.
- The sparse block (router, experts, sigmoid-gated shared expert) equals Hugging Face's Qwen2-MoE and Mixtral blocks
  on the same weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model_runner.layer_configs import ExpertActivation, MoEConfig
from radixserve.model_runner.moe import SparseMoeBlock, select_experts
from radixserve.kernels import cpu_build
from radixserve.model_runner.moe.grouped import grouped_experts, grouped_gemm_experts, sort_by_expert
from radixserve.model_runner.parallel import TPGroup


def reference_gpt_oss_experts(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, alpha, limit):
    """gpt-oss's experts in float64, one token and one expert at a time: biases on both projections and the clamped
    SwiGLU `min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1)`."""
    hidden, w13, w2, topk_weights, w13_bias, w2_bias = (t.double() for t in (hidden, w13, w2, topk_weights, w13_bias,
                                                                             w2_bias))
    intermediate = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j, e in enumerate(topk_ids[t].tolist()):
            gate = (w13[e, :intermediate] @ hidden[t] + w13_bias[e, :intermediate]).clamp(max=limit)
            up = (w13[e, intermediate:] @ hidden[t] + w13_bias[e, intermediate:]).clamp(-limit, limit)
            out[t] += topk_weights[t, j] * (w2[e] @ (gate * torch.sigmoid(alpha * gate) * (up + 1)) + w2_bias[e])
    return out


def random_gpt_oss_experts(num_experts, hidden, intermediate, dtype, seed=0):
    """Weights and biases large enough that the clamps of a limit of 1.5 engage for many of the values."""
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 2 / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate**0.5).to(dtype)
    w13_bias = torch.randn(num_experts, 2 * intermediate, generator=generator).to(dtype)
    w2_bias = torch.randn(num_experts, hidden, generator=generator).to(dtype)
    return w13, w2, w13_bias, w2_bias


def reference_experts(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64, one token and one expert at a time."""
    hidden, w13, w2, topk_weights = (t.double() for t in (hidden, w13, w2, topk_weights))
    intermediate = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j, e in enumerate(topk_ids[t].tolist()):
            gate, up = w13[e, :intermediate] @ hidden[t], w13[e, intermediate:] @ hidden[t]
            out[t] += topk_weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


# ---- routing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_then_topk(renormalize):
    logits = torch.randn(37, 16, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(logits, 4, "softmax_topk", renormalize)
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :4]
    assert torch.equal(ids, expected_ids)
    expected = probs.gather(1, expected_ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)
    assert (weights.sum(-1) < 1 - 1e-3).all() != renormalize


def test_topk_then_softmax_equals_renormalized_softmax_topk():
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights, ids = select_experts(logits, 2, "topk_softmax", renormalize=True)
    top = logits.double().topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(weights.double(), torch.softmax(top.values, dim=-1), rtol=1e-6, atol=1e-7)
    other_weights, other_ids = select_experts(logits, 2, "softmax_topk", renormalize=True)
    assert torch.equal(ids, other_ids)
    torch.testing.assert_close(weights, other_weights, rtol=1e-6, atol=1e-6)


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="sigmoid"):
        select_experts(torch.zeros(2, 4), 2, "sigmoid", False)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8, routing="softmax_topk", renormalize=False,
                  sparse_layers=frozenset())


# ---- grouped experts ----------------------------------------------------------------------------------

def random_experts(num_experts, hidden, intermediate, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 8, 2), (64, 16, 4), (3, 64, 8)])
def test_grouped_experts_equal_float64(dtype, tolerance, num_tokens, num_experts, top_k):
    hidden_size, intermediate = 64, 48
    w13, w2 = random_experts(num_experts, hidden_size, intermediate, dtype)
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), top_k, "softmax_topk",
                                  True)
    out = grouped_gemm_experts(hidden, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == hidden.shape
    expected = reference_experts(hidden, w13, w2, weights, ids)
    error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < tolerance, error


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 8, 2), (3, 64, 8), (8, 16, 8)])
def test_small_experts_kernel_equals_float64(dtype, tolerance, num_tokens, num_experts, top_k):
    """The C++ call that runs a few pairs (`small_experts`), with pairs of another expert-parallel rank (id E) and of
    weight 0 among them, which contribute nothing; `grouped_experts` hands it these calls."""
    if not cpu_build.load():
        pytest.skip("the C++ CPU kernels could not be built here")
    hidden_size, intermediate = 64, 48
    w13, w2 = random_experts(num_experts, hidden_size, intermediate, dtype, seed=num_tokens)
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), top_k, "softmax_topk",
                                  True)
    ids[0, 0] = num_experts  # another rank's expert
    if num_tokens > 1:
        weights[-1, -1] = 0.0
    out = torch.ops.radixserve_cpu.small_experts(hidden, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == hidden.shape
    held = ids < num_experts
    expected = reference_experts(hidden, w13, w2, weights * held, ids.masked_fill(~held, 0))
    error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < tolerance, error
    assert torch.equal(grouped_experts(hidden, w13, w2, weights, ids), out)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (17, 8, 4), (40, 32, 4)])
def test_grouped_experts_with_biases_and_clamped_swiglu_equal_float64(num_tokens, num_experts, top_k):
    hidden_size, intermediate, alpha, limit = 64, 48, 1.702, 1.5
    w13, w2, w13_bias, w2_bias = random_gpt_oss_experts(num_experts, hidden_size, intermediate, torch.float32)
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), top_k, "topk_softmax",
                                  True)
    activation = ExpertActivation("clamped_swiglu", alpha, limit)
    out = grouped_experts(hidden, w13, w2, weights, ids, w13_bias, w2_bias, activation)
    expected = reference_gpt_oss_experts(hidden, w13, w2, weights, ids, w13_bias, w2_bias, alpha, limit)
    error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
    assert error < 2e-5, error
    # The clamps matter at these sizes: without them the result differs.
    unclamped = reference_gpt_oss_experts(hidden, w13, w2, weights, ids, w13_bias, w2_bias, alpha, 1e9)
    assert (unclamped - expected).abs().max() > 1e-2


def test_grouped_experts_with_one_expert_for_every_token_and_idle_experts():
    w13, w2 = random_experts(8, 32, 16, torch.float32, seed=3)
    hidden = torch.randn(9, 32, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([[5, 2]] * 9)  # experts 0, 1, 3, 4, 6, 7 see no token
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(grouped_experts(hidden, w13, w2, weights, ids).double(),
                               reference_experts(hidden, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_sort_by_expert_groups_pairs_in_token_order():
    ids = torch.tensor([[3, 0], [0, 1], [3, 2]])
    order, ends = sort_by_expert(ids, 5)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]  # expert 0: pairs 1, 2; expert 1: 3; 2: 5; 3: 0, 4
    assert ends.tolist() == [2, 3, 4, 6, 6] and ends.dtype == torch.int32


# ---- the block against Hugging Face's ------------------------------------------------------------------

def _hf_block(family: str):
    import transformers

    common = dict(hidden_size=64, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4)
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        config = transformers.Qwen2MoeConfig(num_experts=8, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=48, **common)
        return config, Qwen2MoeSparseMoeBlock(config)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(num_local_experts=8, intermediate_size=32, **common)
    return config, MixtralSparseMoeBlock(config)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_sparse_block_equals_hugging_face(family):
    hf_config, hf_block = _hf_block(family)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in hf_block.parameters():
            param.normal_(0.0, 0.2)
    moe = MoEConfig.from_dict(hf_config.to_dict(), family)
    block = SparseMoeBlock(64, moe, TPGroup.single())
    # HF keeps the experts fused in memory ([E, 2I, H] gate|up and [E, H, I]): the same layout as ours.
    own = {name.replace("experts.gate_up_proj", "experts.w13_weight").replace("experts.down_proj", "experts.w2_weight"):
           tensor for name, tensor in hf_block.state_dict().items()}
    if "shared_expert.gate_proj.weight" in own:
        own["shared_expert.gate_up_proj.weight"] = torch.cat(
            [own.pop("shared_expert.gate_proj.weight"), own.pop("shared_expert.up_proj.weight")])
    block.load_state_dict(own, strict=True)
    hidden = torch.randn(1, 23, 64)
    with torch.no_grad():
        expected = hf_block(hidden)[0]
        got = block(hidden[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- expert parallelism --------------------------------------------------------------------------

@pytest.mark.parametrize("tp_size,ep_size", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_shards_sum_to_the_whole_layer(tp_size, ep_size):
    """Each rank's `FusedMoE` holds E/ep experts and a (tp/ep)-th of their intermediate rows; its output covers only
    the pairs routed to them, and the ranks' outputs (what the all-reduce sums) equal the float64 whole."""
    from radixserve.model_runner.moe import FusedMoE

    generator = torch.Generator().manual_seed(3)
    num_experts, hidden_size, intermediate = 8, 32, 48
    w13 = torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator) * 0.1
    w2 = torch.randn(num_experts, hidden_size, intermediate, generator=generator) * 0.1
    hidden = torch.randn(19, hidden_size, generator=generator)
    topk_weights, topk_ids = select_experts(torch.randn(19, num_experts, generator=generator), 2, "softmax_topk", True)
    topk_ids[0] = torch.tensor([0, num_experts - 1])  # a token whose two experts live on the first and last groups

    total = torch.zeros(hidden.shape, dtype=torch.float64)
    held = []
    for rank in range(tp_size):
        experts = FusedMoE(num_experts, hidden_size, intermediate, TPGroup(rank, tp_size, None, ep_size))
        shard = experts.shard
        assert experts.w13_weight.shape == (num_experts // ep_size, 2 * intermediate * ep_size // tp_size, hidden_size)
        local = slice(shard.first_expert, shard.first_expert + shard.num_local_experts)
        rows = slice(shard.intermediate_start, shard.intermediate_start + shard.intermediate_size)
        with torch.no_grad():
            experts.w13_weight.copy_(torch.cat([w13[local, :intermediate][:, rows], w13[local, intermediate:][:, rows]],
                                               dim=1))
            experts.w2_weight.copy_(w2[local][:, :, rows])
        total += experts(hidden, topk_weights, topk_ids).double()
        held.append((shard.first_expert, shard.num_local_experts, shard.intermediate_start))
    assert len(set(held)) == tp_size  # every rank holds a different part
    expected = reference_experts(hidden, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


def test_a_rank_whose_experts_no_token_visits_contributes_zeros():
    from radixserve.model_runner.moe import FusedMoE

    experts = FusedMoE(8, 16, 32, TPGroup(1, 2, None, 2))  # experts 4..7
    with torch.no_grad():
        experts.w13_weight.normal_()
        experts.w2_weight.normal_()
    ids = torch.tensor([[0, 3], [1, 2]])
    out = experts(torch.randn(2, 16), torch.full((2, 2), 0.5), ids)
    assert torch.equal(out, torch.zeros(2, 16))


def test_batch_invariant_experts_give_a_token_the_same_bits_in_any_batch():
    """CPU deterministic inference (`use_batch_invariant_experts`): 40 tokens of top-4 (160 pairs, past the C++ call's
    usual 64) still run on it, and each token's row equals, bit for bit, the token run alone. Experts the call cannot
    run (gpt-oss's, biased) are refused."""
    from radixserve.model_runner.moe import FusedMoE, use_batch_invariant_experts

    if not cpu_build.load():
        pytest.skip("the C++ CPU kernels could not be built here")
    experts = FusedMoE(16, 64, 48, TPGroup.single())
    w13, w2 = random_experts(16, 64, 48, torch.float32, seed=9)
    experts.w13_weight.data.copy_(w13)
    experts.w2_weight.data.copy_(w2)
    use_batch_invariant_experts(torch.nn.Sequential(experts))
    generator = torch.Generator().manual_seed(9)
    hidden = torch.randn(40, 64, generator=generator)
    weights, ids = select_experts(torch.randn(40, 16, generator=generator), 4, "softmax_topk", True)
    batch = experts(hidden, weights, ids)
    for t in (0, 17, 39):
        assert torch.equal(experts(hidden[t:t + 1], weights[t:t + 1], ids[t:t + 1])[0], batch[t])
    gpt_oss = FusedMoE(4, 64, 48, TPGroup.single(), bias=True,
                       activation=ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0))
    with pytest.raises(ValueError, match="SiLU experts without biases"):
        use_batch_invariant_experts(gpt_oss)
