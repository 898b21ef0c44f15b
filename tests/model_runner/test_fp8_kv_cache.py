"""A float8 KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`, SGLang's names): K and V are stored as float8 and
read back in the activations' dtype.

Kernels: torch_native and Triton (the interpreter on the CPU) against a float64 reference that reads the same
float8-rounded keys and values; FlashInfer on a GPU. The model: a real scheduler on the embedded model keeps a
quarter of float32's bytes per token, leaks nothing (the driver checks the pools every step), and, with the radix
cache on and off, stays close to the float32 cache's greedy tokens and log-probabilities.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from attention_cases import kv_written, make_case, reference_attention, run_backend  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402
from radixserve.radix_cache.pool import TokenToKVPool  # noqa: E402
from radixserve.runtime.wire.server_args import ServerArgs  # noqa: E402
from scheduler_driver import SchedulerDriver  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CASES = {
    "extend": (ForwardMode.EXTEND, ([0, 7, 20], [5, 19, 3])),
    "decode": (ForwardMode.DECODE, ([0, 13, 40, 3], [1, 1, 1, 1])),
}


def _backends():
    yield "torch_native", TorchNativeAttention()
    yield "triton", TritonAttentionBackend(4, 2, 32, DEVICE, max_batch_size=8, max_kv_splits=4)


@pytest.mark.parametrize("kv_name", sorted(FLOAT8))
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_backends_read_float8_kv_as_a_float64_reference_does(kv_name: str, case_name: str) -> None:
    mode, lens = CASES[case_name]
    for name, backend in _backends():
        case = make_case(mode, *lens, num_heads=4, num_kv_heads=2, head_dim=32, page_size=1, dtype=torch.float32,
                         device=DEVICE, kv_dtype=FLOAT8[kv_name])
        out = run_backend(backend, case)
        assert out.dtype == torch.float32 and out.shape == case.q.shape, name
        assert kv_written(case), name  # the new tokens' K/V, rounded to float8, at their slots
        # The reference reads the pool's float8 prefix and the new K/V rounded to float8: only float32 sums differ.
        error = (out.double().cpu() - reference_attention(case)).abs().max().item()
        assert error < 2e-5, f"{name}: max abs error {error}"


def test_the_flag_takes_sglang_names_and_refuses_others() -> None:
    from radixserve.radix_cache import pool
    from radixserve.runtime.wire import server_args

    # The names the flag accepts are the ones the runner can map to a dtype.
    assert set(server_args.KV_CACHE_DTYPES) - {"auto"} == set(pool.KV_CACHE_DTYPES)
    for name in ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"):
        ServerArgs(kv_cache_dtype=name)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ServerArgs(kv_cache_dtype="fp4_e2m1")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not ON_GPU, reason="no GPU"))])
def test_the_host_tier_keeps_float8_kv_byte_for_byte(device: str) -> None:
    from radixserve.radix_cache.host_pool import HostKVPool

    pool = TokenToKVPool(16, 1, 2, 2, 8, torch.float8_e4m3fn, device=device)
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer.copy_(torch.randn(buffer.shape, device=device) * 4)
    host = HostKVPool(pool, 8)
    device_slots, host_slots = torch.tensor([3, 5, 9], device=device), host.alloc(3)
    host.backup(device_slots, host_slots)
    saved = [buffer[device_slots].float() for buffer in pool.k_buffer + pool.v_buffer]
    for buffer in pool.k_buffer + pool.v_buffer:
        buffer[device_slots] = torch.zeros(3, 2, 8, dtype=buffer.dtype, device=device)
    targets = torch.tensor([1, 2, 4], device=device)
    host.load(host_slots, targets)
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(buffer[targets].float(), expected)
               for buffer, expected in zip(pool.k_buffer + pool.v_buffer, saved))


PROMPTS = [
    "The capital of France is Paris. The capital of Italy is",
    "def add(a, b):\n    return",
    "Water boils at 100 degrees Celsius. Ice melts at",
    "List three colors of the rainbow: red, orange,",
]
SHARED = "You are a helpful assistant who answers in one short sentence. "


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [tokenizer.encode(SHARED + text) for text in PROMPTS]


def _greedy(model_dir: str, prompts: list[list[int]], **server_args) -> SchedulerDriver:
    driver = SchedulerDriver(model_dir, max_total_tokens=2048, chunked_prefill_size=16, **server_args)
    for i, prompt in enumerate(prompts):
        driver.submit(f"r{i}", prompt, max_new_tokens=12, return_logprob=True)
    driver.run_until_idle()
    return driver


def _agreement(exact: SchedulerDriver, other: SchedulerDriver) -> int:
    """Leading tokens equal to `exact`'s, over all requests; while they agree, the chosen tokens'
    log-probabilities must stay close."""
    agreeing = 0
    for rid, result in exact.results.items():
        theirs = other.results[rid]
        for token, their_token, logprob, their_logprob in zip(result.output_ids, theirs.output_ids, result.logprobs,
                                                              theirs.logprobs):
            if token != their_token:
                break
            agreeing += 1
            assert abs(logprob - their_logprob) < 0.5, (rid, logprob, their_logprob)
    return agreeing


def test_a_float8_cache_halves_the_bytes_and_stays_close_to_float32_with_the_radix_cache_on_and_off(
        default_model_dir, prompts) -> None:
    exact = _greedy(default_model_dir, prompts)
    cached = _greedy(default_model_dir, prompts, kv_cache_dtype="fp8_e4m3")
    uncached = _greedy(default_model_dir, prompts, kv_cache_dtype="fp8_e4m3", disable_radix_cache=True)
    pool = cached.runner.token_to_kv_pool
    assert pool.dtype == torch.float8_e4m3fn
    float32_bytes = TokenToKVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, torch.float32)
    assert TokenToKVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype) * 4 \
        == float32_bytes
    assert sum(r.cached_tokens for r in cached.results.values()) > 0  # the shared instruction came from the tree
    assert sum(r.cached_tokens for r in uncached.results.values()) == 0
    # Float8 keys differ from the float32 ones by up to one part in 16, so a near-tie may flip a greedy token
    # (and with it everything after); most leading tokens agree and their log-probabilities stay close.
    total = len(prompts) * 12
    for driver in (cached, uncached):
        assert _agreement(exact, driver) >= total // 2
    for driver in (exact, cached, uncached):
        driver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="FlashInfer needs a GPU")
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_flashinfer_reads_float8_kv_as_a_float64_reference_does(mode) -> None:
    pytest.importorskip("flashinfer")
    from radixserve.model_runner.attention.flashinfer_backend import FlashInferAttentionBackend

    lens = {ForwardMode.EXTEND: ([0, 37, 300], [100, 1, 60]), ForwardMode.DECODE: ([0, 15, 700, 63], [1] * 4)}[mode]
    case = make_case(mode, *lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=1, dtype=torch.bfloat16,
                     device="cuda", kv_dtype=torch.float8_e4m3fn)
    out = run_backend(FlashInferAttentionBackend(32, 8, 128, torch.bfloat16, "cuda", page_size=1), case)
    assert out.dtype == torch.bfloat16 and kv_written(case)
    error = (out.double() - reference_attention(case, device="cuda")).abs().max().item()
    assert error < 2e-2, f"max abs error vs float64 reference: {error}"
