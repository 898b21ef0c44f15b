"""TorchNativeAttention against a float64 reference written from the definition of causal attention.

Each case builds real pools (ReqToTokenPool, KVAllocator, TokenToKVPool), puts random "cached prefix" K/V into
the slots of each request's prefix, then runs one layer of the backend on random q/k/v of the new tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.model_runner.attention import create_attention_backend
from radixserve.model_runner.attention.torch_native import TorchNativeAttention
from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.static_generate import assign_kv_slots, make_forward_batch
from radixserve.radix_cache.pool import KVAllocator, ReqToTokenPool, TokenToKVPool

NUM_LAYERS = 3
LAYER = 1  # not layer 0, so a backend indexing the wrong layer's buffer fails
HEAD_DIM = 8


def reference_attention(q, keys, values, prefix_len, scaling):
    """q [ext, H, D]; keys/values [seq, Hkv, D] (prefix then new tokens), float64, one request."""
    num_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for j in range(q.shape[0]):
        visible = prefix_len + j + 1
        for h in range(num_heads):
            kv_head = h // group
            scores = [float(q[j, h] @ keys[t, kv_head]) * scaling for t in range(visible)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for t in range(visible):
                out[j, h] += weights[t] / total * values[t, kv_head]
    return out


def run_case(backend, mode, prefix_lens, extend_lens, page_size, num_heads, num_kv_heads, seed):
    generator = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(size=8, max_context_len=64)
    allocator = KVAllocator(size=512, page_size=page_size)
    kv_pool = TokenToKVPool(512, page_size, NUM_LAYERS, num_kv_heads, HEAD_DIM, torch.float32)
    # Take and give back some pages first so request slots are scattered rather than 1, 2, 3, ...
    scratch = allocator.alloc(5 * page_size)
    rows = [req_pool.alloc() for _ in prefix_lens]
    allocator.free(scratch[::2])

    prefix_k, prefix_v = [], []
    for row, prefix_len in zip(rows, prefix_lens):
        slots = assign_kv_slots(allocator, req_pool, [row], [0], [prefix_len])
        k = torch.randn(prefix_len, num_kv_heads, HEAD_DIM, generator=generator)
        v = torch.randn(prefix_len, num_kv_heads, HEAD_DIM, generator=generator)
        kv_pool.set_kv_buffer(LAYER, slots, k, v)
        prefix_k.append(k)
        prefix_v.append(v)

    out_cache_loc = assign_kv_slots(allocator, req_pool, rows, prefix_lens, extend_lens)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=generator)
    dummy_ids = [[0] * n for n in extend_lens]
    batch = make_forward_batch(mode, rows, prefix_lens, dummy_ids, out_cache_loc, req_pool, kv_pool)
    scaling = HEAD_DIM**-0.5

    backend.plan(batch)
    out = backend.forward(q, k, v, LAYER, scaling, batch)

    assert out.shape == q.shape and out.dtype == q.dtype
    k_buffer, v_buffer = kv_pool.get_kv_buffer(LAYER)
    assert torch.equal(k_buffer[out_cache_loc], k) and torch.equal(v_buffer[out_cache_loc], v)
    start = 0
    for i, (prefix_len, extend_len) in enumerate(zip(prefix_lens, extend_lens)):
        new = slice(start, start + extend_len)
        keys = torch.cat([prefix_k[i], k[new]]).double()
        values = torch.cat([prefix_v[i], v[new]]).double()
        expected = reference_attention(q[new].double(), keys, values, prefix_len, scaling)
        torch.testing.assert_close(out[new].double(), expected, atol=2e-5, rtol=2e-5)
        start += extend_len


# (mode, prefix_lens, extend_lens): fresh prompts, cached prefixes (page-aligned and not), decode, mixed.
CASES = [
    (ForwardMode.EXTEND, [0, 0, 0], [5, 1, 9]),
    (ForwardMode.EXTEND, [3, 0, 8, 6], [4, 7, 1, 2]),
    (ForwardMode.EXTEND, [13], [6]),
    (ForwardMode.DECODE, [1, 7, 12, 4, 30], [1, 1, 1, 1, 1]),
    (ForwardMode.DECODE, [0], [1]),
    (ForwardMode.MIXED, [0, 9, 5, 17], [6, 1, 3, 1]),
]
HEADS = [(4, 2), (3, 3), (6, 1)]  # GQA, plain multi-head, multi-query


# How the backend splits the batch: one padded call, one call per request, or chunks of a few requests.
SPLITS = {
    "padded": dict(max_chunk_pairs=math.inf, max_padding_waste=math.inf),
    "per_request": dict(max_chunk_pairs=0),
    "chunked": dict(max_chunk_pairs=60, max_padding_waste=3.0),
}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_matches_float64_reference(page_size, num_heads, num_kv_heads, case, split):
    mode, prefix_lens, extend_lens = CASES[case]
    backend = TorchNativeAttention(**SPLITS[split])
    run_case(backend, mode, prefix_lens, extend_lens, page_size, num_heads, num_kv_heads, seed=case * 7 + page_size)


def test_default_split_is_correct():
    backend = TorchNativeAttention()
    run_case(backend, ForwardMode.EXTEND, [0, 0, 40, 0], [1, 1, 20, 3], 4, 4, 2, seed=1)
    run_case(backend, ForwardMode.DECODE, [5, 9, 2, 30, 31, 7], [1] * 6, 1, 4, 2, seed=2)


def test_split_requests():
    backend = TorchNativeAttention(max_chunk_pairs=100, max_padding_waste=2.0)
    # Decode: grows while requests x longest <= 100 (query, key) pairs.
    assert backend.split_requests([1] * 5, [20, 30, 10, 25, 40]) == [(0, 3), (3, 5)]
    # Extend: a long prompt runs alone; short ones share a chunk while padding stays under 2x.
    assert backend.split_requests([30, 2, 2, 3, 9], [30, 2, 2, 3, 9]) == [(0, 1), (1, 4), (4, 5)]
    assert TorchNativeAttention(max_chunk_pairs=0).split_requests([1, 1], [5, 5]) == [(0, 1), (1, 2)]
    padded = TorchNativeAttention(max_chunk_pairs=math.inf, max_padding_waste=math.inf)
    assert padded.split_requests([3, 1, 9], [10, 40, 9]) == [(0, 3)]


def test_factory():
    assert isinstance(create_attention_backend("torch_native", None), TorchNativeAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("no_such_backend", None)
    with pytest.raises(ValueError, match="ModelRunner"):
        create_attention_backend("flashinfer", None)


def test_flashinfer_refuses_a_head_size_below_its_kernels(tiny_model_dir):
    """FlashInfer's kernels start at a head size of 64: a model with smaller heads is refused by name, before the
    device is looked at; at 64 the refusal left on a CPU is the device's."""
    from radixserve.model_runner.model_runner import ModelRunner
    from radixserve.model_runner.runner_config import RunnerConfig
    from radixserve.runtime.wire.server_args import ServerArgs

    def runner(head_dim: int) -> ModelRunner:
        return ModelRunner(RunnerConfig.from_server_args(ServerArgs(
            model_path=tiny_model_dir("llama", head_dim=head_dim), device="cpu", max_total_tokens=256,
            max_running_requests=2)))

    with pytest.raises(ValueError, match="head size of 16 .its smallest is 64.; use the triton attention backend"):
        create_attention_backend("flashinfer", runner(16))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_attention_backend("flashinfer", runner(64))
