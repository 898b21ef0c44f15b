"""Batched LoRA on a CUDA device (skipped without one): the Triton gather-matmul kernel (kernels/lora_sgmv.py)
against the torch path and a float64 reference at the embedded model's projection shapes and the largest ranks,
and a real scheduler on the GPU whose mixed batch (two PEFT adapters and the base model) gives Hugging Face's
greedy tokens with each adapter merged."""

from __future__ import annotations

import pytest
import torch

from lora_adapters import make_adapter, merged_greedy
from radixserve.model_runner.lora.layers import LoRABatch, segmented_lora
from scheduler_driver import SchedulerDriver
from test_scheduler import make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (in_features, out_features) of SmolLM2-135M's projections: q/o, k/v, gate/up, down.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_features, out_features", SHAPES)
@pytest.mark.parametrize("rank", [8, 64])
def test_lora_kernel_matches_the_torch_path_on_the_gpu(dtype, in_features, out_features, rank):
    from radixserve.kernels.lora_sgmv import lora_delta

    generator = torch.Generator().manual_seed(in_features + out_features + rank)
    num_slots, num_tokens = 4, 517  # not a multiple of any block size
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator)  # -1: base-model tokens
    x = torch.randn(num_tokens, in_features, generator=generator)
    a = torch.randn(num_slots, rank, in_features, generator=generator) / in_features ** 0.5
    b = torch.randn(num_slots, out_features, rank, generator=generator) / rank ** 0.5
    token_slots = slots.cuda()
    groups = [(s, torch.nonzero(token_slots == s).flatten()) for s in range(num_slots)]
    batch = LoRABatch(groups, num_tokens, token_slots)
    args = [t.to("cuda", dtype) for t in (x, a, b)]
    kernel = lora_delta(*args, token_slots)
    torch_path = segmented_lora(*args, batch)
    expected = torch.zeros(num_tokens, out_features, dtype=torch.float64)
    for s in range(num_slots):
        rows = slots == s
        expected[rows] = (x[rows].double() @ a[s].double().T) @ b[s].double().T
    tolerance = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    assert kernel.dtype == dtype and kernel.shape == (num_tokens, out_features)
    torch.testing.assert_close(kernel.double().cpu(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(kernel.cpu(), torch_path.cpu(), rtol=tolerance, atol=tolerance)
    assert torch.all(kernel[token_slots < 0] == 0)


def test_a_mixed_batch_on_the_gpu_matches_merged_hugging_face(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    adapters = {"every": make_adapter(str(tmp_path / "every"), model_dir, rank=8, seed=1),
                "attn": make_adapter(str(tmp_path / "attn"), model_dir, rank=4, alpha=8.0, seed=2,
                                     modules=("q_proj", "v_proj", "o_proj"))}
    prompts = make_prompts(7, 6, 512, 5, 30)
    names = [None, "every", "attn", "every", None, "attn"]
    # float32 for greedy equality with the float32 reference; triton takes the tiny model's small heads.
    driver = SchedulerDriver(model_dir, device="cuda", dtype="float32", attention_backend="triton",
                             max_total_tokens=16384, max_running_requests=16,
                             lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=2)
    try:
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            driver.submit(f"r{i}", prompt, lora_name=name, max_new_tokens=8)
        steps_with_all = 0
        while not driver.scheduler.is_idle():
            steps_with_all += {r.lora_name for r in driver.scheduler.running} == {None, "every", "attn"}
            driver.step()
        outputs = [driver.results[f"r{i}"].output_ids for i in range(len(prompts))]
    finally:
        driver.close()
    assert steps_with_all > 0
    for name in (None, "every", "attn"):
        picked = [i for i, n in enumerate(names) if n == name]
        assert [outputs[i] for i in picked] == merged_greedy(model_dir, adapters.get(name),
                                                             [prompts[i] for i in picked], 8), name
