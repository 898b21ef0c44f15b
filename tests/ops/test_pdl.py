"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on a Hopper GPU a decode step's chain of
kernels gives the same bits with and without it, in CUDA graphs and eagerly."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import pdl

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.fixture
def pdl_switch():
    """Sets `pdl.ENABLED` for a test and restores it after."""
    before = pdl.ENABLED
    yield lambda on: setattr(pdl, "ENABLED", on)
    pdl.ENABLED = before


def test_cpu_tensors_launch_without_pdl(pdl_switch):
    pdl_switch(True)
    assert pdl.launch_options(torch.zeros(1)) == {"USE_PDL": False}
    assert not pdl.pdl_active(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_launches_follow_the_switch_and_the_capability(pdl_switch):
    x = torch.zeros(1, device="cuda")
    pdl_switch(True)
    expected = {"USE_PDL": True, "launch_pdl": True} if ON_HOPPER else {"USE_PDL": False}
    assert pdl.launch_options(x) == expected
    pdl_switch(False)
    assert pdl.launch_options(x) == {"USE_PDL": False}


class DecodeChain:
    """Three layers of a batch-1 decode step at Qwen3-30B-A3B's shapes on the Triton kernels, each reading what the one
    before it wrote: add + RMSNorm, the QKV product on the skinny kernel, rotary with the per-head norms, split-KV
    decode attention writing the new K/V, the output product, add + RMSNorm in the fused router's launch, the
    experts' decode path; then a dense MLP on the FP8 and 4-bit skinny kernels and SiLU-and-mul. A kernel that read
    its input before the previous kernel finished would give other bits under PDL."""

    hidden, heads, kv_heads, head_dim, experts, top_k, inter, context = 2048, 32, 4, 128, 128, 8, 768, 300

    def __init__(self) -> None:
        from radixserve.model_runner.layers import RotaryEmbedding
        from radixserve.model_runner.quantization.fp8 import Fp8Weight

        g = torch.Generator(device="cuda").manual_seed(0)

        def rand(*shape, scale=0.05, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

        h, d = self.hidden, self.head_dim
        qkv_out = (self.heads + 2 * self.kv_heads) * d
        self.w_qkv, self.w_o = rand(qkv_out, h), rand(h, self.heads * d)
        self.w_router = rand(self.experts, h)
        self.w13, self.w2 = rand(self.experts, 2 * self.inter, h), rand(self.experts, h, self.inter)
        self.norm, self.qk_norm = 1 + rand(h, scale=0.1), 1 + rand(d, scale=0.1)
        self.fp8 = Fp8Weight.quantize(torch.randn(4096, h, generator=g, device="cuda") * 0.05, (128, 128))
        self.qweight = torch.randint(-2**31, 2**31 - 1, (h // 8, 4096), generator=g, device="cuda", dtype=torch.int32)
        self.scales, self.zeros = rand(h // 128, 4096, scale=0.01), torch.full((h // 128, 4096), 8.0, device="cuda",
                                                                                 dtype=torch.bfloat16)
        rotary = RotaryEmbedding(d, max_positions=4096, base=1e6)
        self.cos, self.sin = rotary.cos.cuda(), rotary.sin.cuda()
        slots = self.context + 8
        self.k_buffers = [rand(slots, self.kv_heads, d, scale=1.0) for _ in range(3)]
        self.v_buffers = [rand(slots, self.kv_heads, d, scale=1.0) for _ in range(3)]
        self.req_to_token = torch.arange(slots, device="cuda", dtype=torch.int32)[None, :].contiguous()
        self.req = torch.zeros(1, device="cuda", dtype=torch.int64)
        self.seq_lens = torch.full((1,), self.context, device="cuda", dtype=torch.int32)
        self.positions = torch.full((1,), self.context - 1, device="cuda", dtype=torch.int64)
        self.loc = torch.full((1,), self.context - 1, device="cuda", dtype=torch.int64)
        self.partial_out = torch.empty(1, self.heads, 8, d, device="cuda")
        self.partial_lse = torch.empty(1, self.heads, 8, device="cuda")
        self.x = rand(1, h, scale=1.0)

    def step(self) -> torch.Tensor:
        from radixserve.kernels.fp8_skinny_gemm import w8a16_gemm, w16a16_gemm
        from radixserve.kernels.fused_activation import silu_and_mul
        from radixserve.kernels.fused_moe_triton import fused_moe
        from radixserve.kernels.fused_norm import fused_add_rms_norm, rms_norm
        from radixserve.kernels.fused_rotary import apply_rotary
        from radixserve.kernels.moe_routing import add_norm_route
        from radixserve.kernels.triton_attention import decode_attention
        from radixserve.kernels.w4a16_gemm import w4a16_gemm

        d, q_size, kv_size = self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        hidden, residual = rms_norm(self.x, self.norm, 1e-6), self.x
        for layer in range(3):
            qkv = w16a16_gemm(hidden, self.w_qkv)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = apply_rotary(self.positions, q.view(1, self.heads, d), k.view(1, self.kv_heads, d), self.cos,
                                self.sin, norms=(self.qk_norm, self.qk_norm, 1e-6))
            out = torch.empty_like(q)
            decode_attention(q, self.k_buffers[layer], self.v_buffers[layer], out, self.req_to_token, self.req,
                             self.seq_lens, d**-0.5, self.partial_out, self.partial_lse, 8,
                             new_kv=(k, v.view(1, self.kv_heads, d), self.loc))
            attended = w16a16_gemm(out.view(1, q_size), self.w_o)
            weights, ids, hidden, residual = add_norm_route(attended, residual, self.norm, 1e-6, self.w_router, None,
                                                            self.top_k, "softmax_topk", True)
            experts = fused_moe(hidden, self.w13, self.w2, weights, ids)
            hidden, residual = fused_add_rms_norm(experts, residual, self.norm, 1e-6)
        gate_up = torch.cat([w8a16_gemm(hidden, self.fp8.weight, self.fp8.scale, (128, 128)),
                             w4a16_gemm(hidden, self.qweight, self.scales, self.zeros, 128)], dim=-1)
        return silu_and_mul(gate_up)

    def replayed(self) -> torch.Tensor:
        """The chain captured in a CUDA graph (after a warm-up outside it), replayed once on fresh KV buffers."""
        kv = [t.clone() for t in self.k_buffers + self.v_buffers]
        self.step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = self.step()
        for buffer, original in zip(self.k_buffers + self.v_buffers, kv):
            buffer.copy_(original)
        graph.replay()
        torch.cuda.synchronize()
        return captured.clone()


@pytest.mark.skipif(not ON_HOPPER, reason="programmatic dependent launch needs a GPU of compute capability 9.0+")
@pytest.mark.gpu
def test_decode_chain_gives_the_same_bits_with_and_without_pdl(pdl_switch):
    chain = DecodeChain()
    results = {}
    for on in (False, True):
        pdl_switch(on)
        results[on] = (chain.replayed(), chain.step().clone())
    without, with_pdl = results[False], results[True]
    assert torch.isfinite(without[0]).all() and without[0].abs().max() > 0
    assert torch.equal(with_pdl[0], without[0]) and torch.equal(with_pdl[1], without[1])
    assert torch.equal(with_pdl[0], with_pdl[1])  # the graph's replay and the eager chain agree under PDL too


@pytest.mark.skipif(not ON_HOPPER, reason="programmatic dependent launch needs a GPU of compute capability 9.0+")
@pytest.mark.gpu
def test_tiny_moe_greedy_ids_the_same_with_and_without_pdl(tiny_model_dir, pdl_switch):
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.model_runner.static_generate import greedy_generate
    from radixserve.runtime.wire.server_args import ServerArgs

    model_dir = tiny_model_dir("qwen3_moe")
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([5, 17, 9])]
    ids = {}
    for on in (False, True):
        pdl_switch(on)
        runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
            model_path=model_dir, device="cuda", dtype="bfloat16", attention_backend="triton", cuda_graph_max_bs=4,
            max_total_tokens=4096, max_running_requests=8)))
        assert runner.cuda_graph_runner is not None
        ids[on] = [greedy_generate(runner, [prompt], 16) for prompt in prompts]  # batch 1: the decode paths
        del runner
        torch.cuda.empty_cache()
    assert ids[True] == ids[False]
