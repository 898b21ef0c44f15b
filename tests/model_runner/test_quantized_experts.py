"""A mixture of experts' experts kept quantized (model_runner/quantization/loader.py): in FP8 (`FusedMoE.keep_fp8`),
loaded from a fine-grained FP8 checkpoint as stored or quantized from a 16-bit one under `--quantization fp8`, and in
4 bits (`FusedMoE.keep_int4`) from a GPTQ checkpoint; multiplied by the fused MoE kernels with their scales (under the
Triton interpreter here; on CUDA the loader keeps them so by default).

The CPU default dequantizes such experts at load (test_quantized_checkpoints.py); these tests load the same models
with `quantized_experts=True` into a real runner and check the stored values, the slicing of values, scales and zero
points under tensor and expert parallelism, and the greedy ids against Hugging Face on the dequantized checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model_runner.model_loading import load_model
from radixserve.model_runner.models.moe_base import load_expert_tensor
from radixserve.model_runner.moe import FusedMoE
from radixserve.model_runner.moe.grouped import grouped_experts
from radixserve.model_runner.moe.routing import select_experts
from radixserve.model_runner.parallel import TPGroup
from radixserve.model_runner.quantization.fp8 import FP8_DTYPE, Fp8Weight, expand_blocks
from radixserve.model_runner.quantization.int4 import Int4Weight, unpack_rows
from radixserve.model_runner.static_generate import greedy_generate
from quant_checkpoints import TINY_QUANT_LLAMA, experts_checkpoint
from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model, make_runner, random_prompts


def with_quantized_experts(model_dir: str, **kwargs):
    """A runner for `model_dir` whose model is loaded again with its experts kept in FP8."""
    runner = make_runner(model_dir, **kwargs)
    model = load_model(runner, runner.config.model, quantized_experts=True)
    model.set_attention_backend(runner.attn_backend)
    runner.model = model
    return runner


def dequantized(experts: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """`w13 [E, 2I, H]`, `w2 [E, H, I]` as float32 values (computed in float64, rounded once): FP8 `weight * scale`,
    the experts' gate, up and down each scaled from its own scale rows; 4 bits `(q - zero) * scale` per group."""
    if experts.is_int4:
        stacks = ((experts.w13_weight, experts.w13_weight_scale, experts.w13_weight_zeros),
                  (experts.w2_weight, experts.w2_weight_scale, experts.w2_weight_zeros))
        return tuple(torch.stack([int4_values(q, s, z, block[1]) for q, s, z in zip(*tensors)]).float()
                     for tensors, block in zip(stacks, experts.scale_blocks))
    (w13_block, w2_block), local = experts.scale_blocks, experts.w2_weight.shape[2]
    gate_rows = -(-local // w13_block[0])

    def values(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        full = expand_blocks(scale.double(), weight.shape[0], weight.shape[1], block)
        return (weight.double() * full).float()

    w13 = torch.stack([torch.cat([values(w[:local], s[:gate_rows], w13_block),
                                  values(w[local:], s[gate_rows:], w13_block)])
                       for w, s in zip(experts.w13_weight, experts.w13_weight_scale)])
    w2 = torch.stack([values(w, s, w2_block) for w, s in zip(experts.w2_weight, experts.w2_weight_scale)])
    return w13, w2


def checkpoint_with_quantized_experts(tmp_path_factory, tiny_model_dir, fmt: str):
    """A tiny Qwen3-MoE written in `fmt` (quant_checkpoints.experts_checkpoint), loaded with its experts kept
    quantized: (the runner, the dequantized reference's directory, the stored tensors, the reference's tensors)."""
    from safetensors.torch import load_file

    base = tiny_model_dir("qwen3_moe", **TINY_QUANT_LLAMA, moe_intermediate_size=128)
    out, reference = str(tmp_path_factory.mktemp(f"{fmt}-experts")), str(tmp_path_factory.mktemp(f"{fmt}-ref"))
    experts_checkpoint(base, out, reference, fmt)
    return (with_quantized_experts(out), reference, load_file(f"{out}/model.safetensors"),
            load_file(f"{reference}/model.safetensors"))


def assert_hugging_faces_ids(runner, reference_dir: str) -> None:
    """Greedy ids over 32 tokens for 8 prompts equal Hugging Face's on the dequantized checkpoint for at least 7."""
    prompts = random_prompts(TINY_QUANT_LLAMA["vocab_size"], [5 + 3 * i for i in range(8)], seed=1)
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS)
    hf = hf_model(reference_dir)
    agree = sum(tokens == hf_greedy(hf, prompt, MAX_NEW_TOKENS, []) for prompt, tokens in zip(prompts, ours))
    assert agree >= 7, f"{agree} of {len(prompts)} prompts give Hugging Face's greedy ids"


def int4_values(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """One expert's `[N, K]` float64 values from `Int4Weight`'s `qweight [K / 8, N]`, scales and zeros `[K / group,
    N]`."""
    q = unpack_rows(qweight).double()
    groups = torch.arange(q.shape[0]) // group
    return ((q - zeros.double()[groups]) * scales.double()[groups]).T


def test_fp8_checkpoint_experts_stay_fp8_and_give_hugging_faces_ids(tmp_path_factory, tiny_model_dir):
    """Qwen3-MoE with every expert in 128 x 128 FP8 blocks (Qwen3-30B-A3B-FP8's layout): the experts hold the stored
    bytes and scales, their values are the checkpoint's dequantized ones, and greedy ids over 32 tokens match Hugging
    Face's on the dequantized checkpoint."""
    runner, reference, stored, expected = checkpoint_with_quantized_experts(tmp_path_factory, tiny_model_dir, "hf-fp8")
    experts = runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8_DTYPE
    assert experts.scale_blocks == ((128, 128), (128, 128))
    w13, w2 = dequantized(experts)
    for e in (0, 5):
        down = f"model.layers.1.mlp.experts.{e}.down_proj"
        assert torch.equal(experts.w2_weight[e].view(torch.uint8), stored[f"{down}.weight"].view(torch.uint8))
        assert torch.equal(experts.w2_weight_scale[e], stored[f"{down}.weight_scale_inv"])
        gate, up = w13[e].split(128)
        assert torch.equal(gate, expected[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(up, expected[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(w2[e], expected[f"{down}.weight"])
    assert_hugging_faces_ids(runner, reference)


def test_online_fp8_quantizes_every_expert(tiny_model_dir):
    """`--quantization fp8` on a 16-bit Qwen3-MoE: each expert's gate, up and down quantized with one scale (per
    tensor, as the linears, held one per row), the stored values exactly `Fp8Weight.quantize`'s, and a MoE layer's
    output the grouped product of those values."""
    from safetensors.torch import load_file

    base = tiny_model_dir("qwen3_moe", **TINY_QUANT_LLAMA, moe_intermediate_size=64)
    runner = with_quantized_experts(base, quantization="fp8")
    source = load_file(f"{base}/model.safetensors")
    layer = runner.model.model.layers[0].mlp
    experts = layer.experts
    assert experts.scale_blocks == ((1, 256), (1, 64)) and experts.w13_weight_scale.shape[1:] == (128, 1)
    w13, w2 = dequantized(experts)
    for e in (0, 3):
        up = Fp8Weight.quantize(source[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], per_tensor=True)
        assert torch.equal(w13[e, 64:], (up.weight.double() * up.scale.double()[:, None]).float())
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 256, generator=generator)
    weights, ids = select_experts(layer.gate(hidden), layer.top_k, layer.routing, layer.renormalize)
    out = experts(hidden, weights, ids)
    expected = grouped_experts(hidden, w13, w2, weights, ids)
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-5
    prompts = random_prompts(runner.vocab_size, [6, 9], seed=4)
    assert all(len(tokens) == 4 for tokens in greedy_generate(runner, prompts, 4))


def expert_checkpoint(num_experts: int, hidden: int, intermediate: int, block):
    """Each expert's gate, up and down `Fp8Weight.quantize`d, as checkpoint tensors `(name, tensor)` (the scales as
    the FP8 loader hands them to the model: `[N, 1]` per row)."""
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for e in range(num_experts):
        for projection, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                                  ("down_proj", (hidden, intermediate))):
            q = Fp8Weight.quantize(torch.randn(*shape, generator=generator), block)
            tensors[f"experts.{e}.{projection}.weight"] = q.weight
            tensors[f"experts.{e}.{projection}.weight_scale"] = q.scale if block else q.scale[:, None]
    return tensors


@pytest.mark.parametrize("block", [(128, 128), None], ids=["blocks", "per_row"])
def test_a_tensor_parallel_rank_takes_its_slice_of_values_and_scales(block):
    """Rank 1 of 2 holds rows 128..255 of each expert's gate and up (scale row 1 of 2 in 128-row blocks) and the same
    columns of its down (scale column 1); with per-row scales, down's one scale column whole."""
    hidden, intermediate = 256, 256
    tensors = expert_checkpoint(2, hidden, intermediate, block)
    experts = FusedMoE(2, hidden, intermediate, TPGroup(rank=1, size=2))
    assert experts.keep_fp8(block)
    for name, tensor in tensors.items():
        _, e, projection, _ = name.split(".")
        load_expert_tensor(experts, name, int(e), projection, tensor)
    for e in range(2):
        gate, up = experts.w13_weight[e].split(128)
        assert torch.equal(gate.view(torch.uint8), tensors[f"experts.{e}.gate_proj.weight"][128:].view(torch.uint8))
        assert torch.equal(up.view(torch.uint8), tensors[f"experts.{e}.up_proj.weight"][128:].view(torch.uint8))
        down = tensors[f"experts.{e}.down_proj.weight"][:, 128:]
        assert torch.equal(experts.w2_weight[e].view(torch.uint8), down.view(torch.uint8))
        gate_scale, up_scale = experts.w13_weight_scale[e].chunk(2)
        full_gate = tensors[f"experts.{e}.gate_proj.weight_scale"]
        full_down = tensors[f"experts.{e}.down_proj.weight_scale"]
        assert torch.equal(gate_scale, full_gate[1:2] if block else full_gate[128:])
        assert torch.equal(experts.w2_weight_scale[e], full_down[:, 1:2] if block else full_down)
        assert torch.equal(up_scale, tensors[f"experts.{e}.up_proj.weight_scale"][1:2] if block else
                           tensors[f"experts.{e}.up_proj.weight_scale"][128:])


def test_fp8_experts_are_refused_where_a_rank_would_cut_a_scale_block_and_other_ranks_experts_go_unread():
    experts = FusedMoE(4, 256, 128, TPGroup(rank=0, size=2))  # 64 rows of each expert per rank: half a block
    assert not experts.keep_fp8((128, 128)) and experts.w13_weight.dtype == torch.float32
    assert experts.keep_fp8(None)  # one scale per row never straddles ranks
    whole = FusedMoE(4, 256, 128, TPGroup(rank=1, size=2, ep_size=2))  # experts 2 and 3, whole
    assert whole.keep_fp8((128, 128))

    class Unreadable:
        def __getitem__(self, index):
            raise AssertionError("another rank's expert was read")

    assert load_expert_tensor(whole, "experts.0.up_proj.weight_scale", 0, "up_proj", Unreadable()) == \
        ("w13_weight_scale", 1)
    with pytest.raises(ValueError, match="float32"):  # a 16-bit weight is never quantized silently by the copy
        load_expert_tensor(whole, "experts.2.down_proj.weight", 2, "down_proj", torch.zeros(256, 128))


@pytest.fixture(scope="module")
def gptq_experts(tmp_path_factory, tiny_model_dir):
    return checkpoint_with_quantized_experts(tmp_path_factory, tiny_model_dir, "gptq")


def test_gptq_experts_stay_4bit(gptq_experts):
    """Qwen3-MoE in GPTQ (groups of 128, asymmetric, every projection): the experts hold the packed words, scales and
    zero points, and their values are the checkpoint's dequantized ones."""
    runner, _, stored, expected = gptq_experts
    experts = runner.model.model.layers[1].mlp.experts
    assert experts.is_int4 and experts.w13_weight.dtype == torch.int32 and experts.scale_blocks == ((1, 128), (1, 128))
    assert torch.equal(experts.w2_weight[3], stored["model.layers.1.mlp.experts.3.down_proj.qweight"])
    w13, w2 = dequantized(experts)
    for e in (0, 5):
        gate, up = w13[e].split(128)
        torch.testing.assert_close(gate, expected[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        torch.testing.assert_close(up, expected[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
        torch.testing.assert_close(w2[e], expected[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])


@pytest.mark.slow
def test_gptq_experts_give_hugging_faces_ids(gptq_experts):
    """The 4-bit experts through the fused kernels (interpreted): greedy ids over 32 tokens match Hugging Face's on the
    dequantized checkpoint (the FP8 experts' test above runs the same comparison among the fast tests)."""
    runner, reference, _, _ = gptq_experts
    assert_hugging_faces_ids(runner, reference)


def test_a_tensor_parallel_rank_takes_its_slice_of_4bit_experts():
    """Rank 1 of 2, groups of 128: gate's and up's columns 128..255 of the packed words, scales and zero points, and
    down's words 16..31 (features 128..255) with its scale and zero row 1. An intermediate size that leaves a rank a
    group and a half keeps 16-bit experts."""
    hidden, intermediate = 256, 256
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for e in range(2):
        for projection, shape in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                                  ("down_proj", (hidden, intermediate))):
            q = Int4Weight.quantize(torch.randn(*shape, generator=generator), 128, torch.float32)
            for suffix, value in (("weight", q.qweight), ("weight_scale", q.scales), ("weight_zeros", q.zeros)):
                tensors[f"experts.{e}.{projection}.{suffix}"] = value
    experts = FusedMoE(2, hidden, intermediate, TPGroup(rank=1, size=2))
    assert experts.keep_int4(128)
    for name, tensor in tensors.items():
        _, e, projection, _ = name.split(".")
        load_expert_tensor(experts, name, int(e), projection, tensor)
    for e in range(2):
        for mine, full in ((experts.w13_weight[e], "gate_proj.weight"),
                           (experts.w13_weight_scale[e], "gate_proj.weight_scale"),
                           (experts.w13_weight_zeros[e], "gate_proj.weight_zeros")):
            assert torch.equal(mine[:, :128], tensors[f"experts.{e}.{full}"][:, 128:])
        assert torch.equal(experts.w13_weight[e][:, 128:], tensors[f"experts.{e}.up_proj.weight"][:, 128:])
        assert torch.equal(experts.w2_weight[e], tensors[f"experts.{e}.down_proj.weight"][16:])
        assert torch.equal(experts.w2_weight_scale[e], tensors[f"experts.{e}.down_proj.weight_scale"][1:])
        assert torch.equal(experts.w2_weight_zeros[e], tensors[f"experts.{e}.down_proj.weight_zeros"][1:])
    cut = FusedMoE(2, hidden, 384, TPGroup(rank=0, size=2))  # 192 features a rank: one group and a half
    assert not cut.keep_int4(128) and cut.w2_weight.dtype == torch.float32
    assert FusedMoE(2, hidden, 128, TPGroup(rank=1, size=2)).keep_int4(128)  # one group spans both ranks' halves
