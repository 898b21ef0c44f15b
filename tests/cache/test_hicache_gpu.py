"""The hierarchical cache on a CUDA device: demotions copy device KV into pinned host memory on a side stream and
loads copy it back before the extend that needs it, so this is where those copies' stream ordering is really
exercised. The multi-turn conversations of test_hicache_scheduler (a pool far smaller than their working set) on
a tiny Llama in float32: every output equals the run with the tier off. Skipped without CUDA."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_hicache_scheduler import run_conversations

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("config", [
    dict(hicache_write_policy="write_through", disable_overlap_schedule=True),
    dict(hicache_write_policy="write_back", disable_overlap_schedule=False),
], ids=["write_through", "write_back-overlap"])
def test_same_outputs_on_cuda_with_prefixes_loaded_back(config, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    common = dict(device="cuda", dtype="float32", attention_backend="triton")  # FlashInfer has no float32
    expected, info_off = run_conversations(model_dir, vocab, disable_overlap_schedule=False, **common)
    outputs, info = run_conversations(model_dir, vocab, enable_hierarchical_cache=True, **config, **common)
    assert outputs == expected
    assert info["cache"]["hicache"]["loaded_from_host_tokens"] > 0
    assert info["cache"]["hit_rate"] > info_off["cache"]["hit_rate"]
    memory = info["memory"]
    assert memory["total_tokens"] == memory["free_tokens"] + memory["evictable_tokens"]
