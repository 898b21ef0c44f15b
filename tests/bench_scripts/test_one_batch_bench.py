"""`benchmarks/one_batch.py` and its floors, on the CPU.

- The bytes a decode step reads and the FLOPs of a prefill, for the shipped Llama-3.1-8B config, against
  counts worked out by hand from the published shape (about 15.0 GB of weights read per decode step).
- A whole run of the benchmark on a tiny random-weight config with torch_native: every requested row is
  measured, the JSON holds each decode step's floor as (weight bytes + KV bytes) / measured bandwidth, and the
  decode and prefill profiles list the matmuls among their top ops.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import one_batch  # noqa: E402
import roofline  # noqa: E402
from radixserve.model_runner.model_config import ModelConfig  # noqa: E402
from radixserve.model_runner.models import get_model_class  # noqa: E402

LLAMA_8B_CONFIG = ROOT / "benchmarks" / "configs" / "llama-3.1-8b.json"
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    "max_position_embeddings": 256, "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def test_llama_8b_bytes_and_flops():
    config = ModelConfig.from_dict(json.loads(LLAMA_8B_CONFIG.read_text()))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert config.rope_scaling["rope_type"] == "llama3"
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=2048).to(torch.bfloat16)

    h, q, kv, inter, layers, vocab = 4096, 4096, 1024, 14336, 32, 128256
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h  # qkv, o, gate/up/down, two norms
    assert layer_params * layers + 2 * vocab * h + h == 8_030_261_248  # Llama-3.1-8B's published size
    # A step reads everything but the input embedding table (only the batch's rows of it).
    read = roofline.weight_bytes_read_per_decode_step(model)
    assert read == 2 * (layer_params * layers + h + vocab * h) == 15_009_849_344

    tokens = 1024
    attention = 4 * layers * 32 * 128 * (tokens * (tokens + 1) // 2)
    assert roofline.prefill_flops(model, 1, tokens) == 2 * layer_params * layers * tokens + attention + 2 * h * vocab


@pytest.mark.parametrize("kv_cache_dtype,kv_element_bytes", [("auto", 4), ("fp8_e4m3", 1)])
def test_run_on_cpu_with_a_dummy_config(tmp_path, kv_cache_dtype, kv_element_bytes):
    config_path = tmp_path / "tiny.json"
    config_path.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    code = one_batch.main([
        "--config", str(config_path), "--device", "cpu", "--attention-backend", "torch_native",
        "--prefill-batch-sizes", "1,2", "--input-len", "16", "--prefill-repeats", "2",
        "--decode-batch-sizes", "1,3", "--context-len", "24", "--steps", "3", "--warmup", "1",
        "--kv-cache-dtype", kv_cache_dtype, "--profile-batch-size", "3", "--profile-prefill-batch-size", "2",
        "--out", str(out), "--tag", "tiny",
    ])
    assert code == 0
    result = json.loads((out / "tiny.json").read_text())
    assert result["errors"] == [] and result["environment"]["device"] == "cpu"
    assert [r["batch"] for r in result["prefill"]] == [1, 2]
    assert [r["batch"] for r in result["decode"]] == [1, 3]  # no eager repeats without CUDA graphs
    assert all(r["ms"] > 0 and r["tokens"] == r["batch"] * 16 for r in result["prefill"])
    for key, mode, batch, length in (("profile", "decode", 3, 24), ("prefill_profile", "prefill", 2, 16)):
        profile = result[key]
        assert (profile["mode"], profile["batch"], profile["context_len"]) == (mode, batch, length)
        assert profile["device_us_per_step"] > 0
        assert any("linear" in k["name"] or "mm" in k["name"] for k in profile["top_kernels"])

    # Every parameter but the untied input embedding table, in float32.
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert result["weight_gb"] * 1e9 == pytest.approx(4 * (2 * layer + 64 + 512 * 64))
    bandwidth = result["bandwidth_tb_s"] * 1e12
    assert bandwidth > 0
    kv_bytes_per_token = 2 * 2 * 2 * 16 * kv_element_bytes  # K and V, 2 layers, 2 KV heads, head_dim 16
    for r in result["decode"]:
        assert r["cuda_graph"] is False and r["step_ms"] > 0 and r["back_to_back_ms"] > 0
        assert r["kv_gb"] * 1e9 == pytest.approx(r["batch"] * 24 * kv_bytes_per_token)
        expected_floor = (r["weight_gb"] + r["kv_gb"]) * 1e9 / bandwidth * 1e3
        assert r["floor_ms"] == pytest.approx(expected_floor)
        assert r["floor_fraction"] == pytest.approx(r["floor_ms"] / r["step_ms"])


def test_a_mixture_of_experts_decode_step_reads_only_the_visited_experts():
    """Qwen3-30B-A3B's published config on the meta device: a batch-1 step reads attention, routers, 8 of each layer's
    128 experts and the LM head (about 3.0B parameters of 30.5B); a large batch visits nearly every expert, and a
    prefill token runs k of E experts' FLOPs."""
    config = ModelConfig.from_dict(json.loads((ROOT / "benchmarks" / "configs" / "qwen3-30b-a3b.json").read_text()))
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, max_positions=64).to(torch.bfloat16)
    experts = 48 * 128 * 3 * 768 * 2048
    others = sum(p.numel() for p in model.parameters()) - experts - config.vocab_size * config.hidden_size  # no embed
    assert roofline.weight_bytes_read_per_decode_step(model, 1) == pytest.approx(2 * (others + experts * 8 / 128))
    assert 5.9 < roofline.weight_bytes_read_per_decode_step(model, 1) / 1e9 < 6.2  # about 3.0B bf16 parameters
    assert roofline.weight_bytes_read_per_decode_step(model, 512) == pytest.approx(2 * (others + experts), rel=1e-6)
    layer_params = sum(p.numel() for p in model.model.layers.parameters()) - experts * (1 - 8 / 128)
    assert roofline.prefill_flops(model, 1, 1) == pytest.approx(2 * layer_params + 4 * 48 * 32 * 128
                                                                + 2 * 2048 * config.vocab_size)
