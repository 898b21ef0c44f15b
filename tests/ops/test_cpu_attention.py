"""The C++ CPU attention kernel (`--attention-backend cpu`) against a float64 reference and torch_native.

Batches come from the real KV pools with scattered slots and random KV everywhere (attention_cases.py); the
shared-prefix layouts are those of test_attention_shared_prefix.py, so grouped requests read their common keys
through the kernel's group path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_cases import kv_written, make_case, reference_attention, run_backend, share_prefixes  # noqa: E402
from radixserve.kernels import cpu_build
from radixserve.model_runner.attention.cpu_backend import (MAX_KERNEL_EXTEND_LEN, CpuAttentionBackend,
                                                           CpuAttentionPlan)
from radixserve.model_runner.attention.torch_native import TorchNativeAttention
from radixserve.model_runner.forward_batch import ForwardMode
from test_attention_shared_prefix import GROUP_LENS, LAYER, LAYOUTS, build, reference  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built")
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


CASES = [
    # (mode, prefix_lens, extend_lens)
    (ForwardMode.DECODE, [0, 5, 31, 32, 33, 200], [1] * 6),
    (ForwardMode.DECODE, [700], [1]),
    (ForwardMode.EXTEND, [0], [1]),
    (ForwardMode.EXTEND, [0, 0], [37, 16]),
    (ForwardMode.EXTEND, [40, 0, 3], [70, 5, 33]),
    (ForwardMode.MIXED, [10, 64, 0], [1, 20, 1]),
]


@pytest.mark.parametrize("mode,prefix_lens,extend_lens", CASES)
# head_dim 48 and 80: a row's columns end in a chunk of 3 or 1 vectors (for_column_chunks).
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (4, 2, 16), (6, 1, 32), (2, 2, 128), (2, 1, 80), (3, 3, 48)])
def test_matches_float64_reference(mode, prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim):
    case = make_case(mode, prefix_lens, extend_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=1, dtype=torch.float32, seed=sum(prefix_lens) + num_heads)
    backend = CpuAttentionBackend(max_extend_len=None)
    out = run_backend(backend, case)
    assert isinstance(case.batch.attn_metadata, CpuAttentionPlan)
    assert kv_written(case)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 1, 80)])
def test_float16_pool_under_float32_queries_matches_float64_reference(mode, prefix_lens, extend_lens, num_heads,
                                                                      num_kv_heads, head_dim):
    # The GGUF blocks' default on the CPU: float32 queries and new k/v, keys and values stored as float16 (the
    # reference reads the float16 values, so only the kernel's float32 arithmetic differs).
    case = make_case(mode, prefix_lens, extend_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=1, dtype=torch.float32, kv_dtype=torch.float16,
                     seed=sum(prefix_lens) + head_dim)
    out = run_backend(CpuAttentionBackend(max_extend_len=None), case)
    assert isinstance(case.batch.attn_metadata, CpuAttentionPlan) and out.dtype == torch.float32
    assert kv_written(case)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 1, 80)])
def test_bfloat16_pool_under_float32_queries_is_the_bfloat16_kernel(mode, prefix_lens, extend_lens, num_heads,
                                                                     num_kv_heads, head_dim):
    # `--kv-cache-dtype bfloat16` under a float32 model: the kernel rounds the queries and the new k/v to bfloat16 and
    # attends as for a bfloat16 model, its output back in float32. The same batch in bfloat16 gives the same bits.
    args = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=1,
                seed=sum(prefix_lens) + head_dim)
    case = make_case(mode, prefix_lens, extend_lens, dtype=torch.float32, kv_dtype=torch.bfloat16, **args)
    twin = make_case(mode, prefix_lens, extend_lens, dtype=torch.bfloat16, **args)
    for layer in range(len(case.batch.token_to_kv_pool.k_buffer)):  # the same keys and values in both pools
        for pool in ("k_buffer", "v_buffer"):
            getattr(twin.batch.token_to_kv_pool, pool)[layer].copy_(getattr(case.batch.token_to_kv_pool, pool)[layer])
    twin.q, twin.k, twin.v = (t.to(torch.bfloat16) for t in (case.q, case.k, case.v))
    out = run_backend(CpuAttentionBackend(max_extend_len=None), case)
    assert isinstance(case.batch.attn_metadata, CpuAttentionPlan) and out.dtype == torch.float32
    assert kv_written(case)
    expected = run_backend(CpuAttentionBackend(max_extend_len=None), twin)
    assert torch.equal(out, expected.float())
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-2, rtol=2e-2)


def test_float16_pool_under_float16_queries_runs_torch_native():
    # float16 queries are no dtype the kernel takes: the batch goes to the reference path, whose answer it keeps.
    case = make_case(ForwardMode.DECODE, [5, 40], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float16, seed=3)
    backend = CpuAttentionBackend()
    out = run_backend(backend, case)
    assert out.dtype == torch.float16 and not isinstance(case.batch.attn_metadata, CpuAttentionPlan)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_bfloat16_is_as_close_as_torch_native(page_size):
    args = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=page_size, dtype=torch.bfloat16, seed=7)
    case = make_case(ForwardMode.EXTEND, [30, 0, 90], [3, 40, 1], **args)
    expected = reference_attention(case)
    out = run_backend(CpuAttentionBackend(max_extend_len=None), case)
    assert out.dtype == torch.bfloat16 and kv_written(case)
    case_ref = make_case(ForwardMode.EXTEND, [30, 0, 90], [3, 40, 1], **args)
    native = run_backend(TorchNativeAttention(), case_ref)
    error = (out.double() - expected).abs().max()
    native_error = (native.double() - expected).abs().max()
    assert error <= 2 * native_error + 1e-3, (error, native_error)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (4, 2, 16), (2, 2, 128), (6, 1, 32), (2, 1, 80), (3, 3, 48)])
def test_bfloat16_decode_is_as_close_as_torch_native(num_heads, num_kv_heads, head_dim):
    # A few rows per KV head: bfloat16 pair products for the scores, and the probabilities rounded to bfloat16
    # against pairs of value rows, where the CPU has AVX-512 BF16 (float32 elsewhere).
    args = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=1,
                dtype=torch.bfloat16, seed=head_dim)
    lens = [0, 5, 31, 32, 33, 200, 700]
    case = make_case(ForwardMode.DECODE, lens, [1] * len(lens), **args)
    expected = reference_attention(case)
    out = run_backend(CpuAttentionBackend(), case)
    assert isinstance(case.batch.attn_metadata, CpuAttentionPlan)
    native = run_backend(TorchNativeAttention(), make_case(ForwardMode.DECODE, lens, [1] * len(lens), **args))
    error = (out.double() - expected).abs().max()
    native_error = (native.double() - expected).abs().max()
    assert error <= 2 * native_error + 1e-3, (error, native_error)


# Groups of requests on one cached prefix (share_prefixes): the group path reads the shared keys once for the
# members' query rows, as lanes of vectors in blocks of up to 64 rows per KV head.
SHARED_CASES = [
    # (mode, prefix_lens, extend_lens, group_size, shared_len)
    (ForwardMode.DECODE, [130] * 16 + [101, 140], [1] * 18, 8, 100),  # 2 groups of 8, then a pair
    (ForwardMode.DECODE, [40, 75, 33], [1] * 3, 3, 33),  # a partial key tile, members of unequal length
    (ForwardMode.EXTEND, [64, 80, 70, 99], [3, 5, 1, 7], 4, 64),  # causal own keys within the group
    (ForwardMode.EXTEND, [50] * 8, [12] * 8, 8, 48),  # 96 tokens: several groups of up to 64, several row blocks
    (ForwardMode.EXTEND, [70] * 4, [32] * 4, 4, 64),  # the shared-prefix workload's 32-token extends, 2 a group
]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    # With one thread the batches of two or more groups run each group as one unit of every KV head; with two,
    # groups of fewer than four run as one unit per KV head (the kernel's kGroupsPerThread).
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,group_size,shared_len", SHARED_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (6, 1, 32), (2, 2, 128)])
def test_shared_prefix_groups_match_float64_reference(mode, prefix_lens, extend_lens, group_size, shared_len,
                                                      num_heads, num_kv_heads, head_dim, threads):
    case = make_case(mode, prefix_lens, extend_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=1, dtype=torch.float32, seed=len(prefix_lens) + head_dim)
    share_prefixes(case, group_size, shared_len)
    backend = CpuAttentionBackend(max_extend_len=None)
    out = run_backend(backend, case)
    assert case.batch.attn_metadata.num_groups_shared >= 1
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,group_size,shared_len", SHARED_CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 2, 128)])
@pytest.mark.parametrize("amx", [True, False])
def test_shared_prefix_groups_bfloat16_are_as_close_as_torch_native(mode, prefix_lens, extend_lens, group_size,
                                                                    shared_len, num_heads, num_kv_heads, head_dim,
                                                                    amx, threads):
    # On a CPU with AMX-BF16 the scores run on tiles unless the backend is told not to (`--cpu-kernels auto,-amx`:
    # then, as on a CPU without, AVX-512 BF16 dot products or float32 ones); head_dim 16 is not a multiple of the
    # tiles' 32.

    def shared_case():
        case = make_case(mode, prefix_lens, extend_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, page_size=1, dtype=torch.bfloat16, seed=3)
        return share_prefixes(case, group_size, shared_len)

    case = shared_case()
    expected = reference_attention(case)
    out = run_backend(CpuAttentionBackend(max_extend_len=None, amx=amx), case)
    assert out.dtype == torch.bfloat16 and case.batch.attn_metadata.num_groups_shared >= 1
    native = run_backend(TorchNativeAttention(min_shared_prefix=1), shared_case())
    error = (out.double() - expected).abs().max()
    native_error = (native.double() - expected).abs().max()
    assert error <= 2 * native_error + 1e-3, (error, native_error)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,group_size,shared_len", SHARED_CASES)
def test_float16_pool_shared_prefix_groups_match_float64_reference(mode, prefix_lens, extend_lens, group_size,
                                                                   shared_len, threads):
    case = make_case(mode, prefix_lens, extend_lens, num_heads=9, num_kv_heads=3, head_dim=64, page_size=1,
                     dtype=torch.float32, kv_dtype=torch.float16, seed=len(prefix_lens))
    share_prefixes(case, group_size, shared_len)
    out = run_backend(CpuAttentionBackend(max_extend_len=None), case)
    assert case.batch.attn_metadata.num_groups_shared >= 1
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", list(LAYOUTS))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 1)])
@pytest.mark.parametrize("split_prefixes", [False, True])
@pytest.mark.parametrize("max_group_tokens", [64, 2])
def test_shared_prefix_groups(mode, num_heads, num_kv_heads, split_prefixes, max_group_tokens):
    batch, q, k, v = build(mode, 1, num_heads, num_kv_heads, torch.float32, seed=num_heads,
                           split_prefixes=split_prefixes, head_dim=16)
    backend = CpuAttentionBackend(min_shared_prefix=1, max_group_tokens=max_group_tokens, max_extend_len=None)
    backend.plan(batch)
    plan = batch.attn_metadata
    # Both groups read their shared keys once (split into smaller groups when their tokens exceed the limit).
    shared_lengths = (plan.group_kv_indptr[1:] - plan.group_kv_indptr[:-1]).tolist()
    assert sorted(set(shared_lengths) - {0}) == sorted(GROUP_LENS.values())
    if max_group_tokens == 64:
        assert plan.num_groups_shared == 2
    scaling = 16 ** -0.5
    expected = reference(batch, q, k, v, scaling)
    out = backend.forward(q, k, v, LAYER, scaling, batch)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float64, 16), (torch.float32, 8)])
def test_falls_back_to_torch_native_outside_its_dtypes_and_head_sizes(dtype, head_dim):
    case = make_case(ForwardMode.DECODE, [4, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     page_size=1, dtype=dtype, seed=1)
    out = run_backend(CpuAttentionBackend(), case)
    assert not isinstance(case.batch.attn_metadata, CpuAttentionPlan)
    tolerance = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), reference_attention(case), atol=tolerance, rtol=tolerance)


def test_build_is_cached_per_cpu_and_source():
    directory = cpu_build.build_directory()
    assert directory.is_dir() and any(directory.glob("*.so"))
    assert cpu_build.ready() and cpu_build.load()
    assert directory.parent.name == "kernels" and directory.name.startswith("cpu-")


def test_checkouts_of_the_same_sources_build_in_folders_of_their_own(tmp_path, monkeypatch):
    """torch's builder writes the source paths into its ninja file: two checkouts sharing a folder would rebuild
    the library each time the other one had used it last."""
    copy = tmp_path / "kernels"
    copy.mkdir()
    for source in cpu_build.SOURCES + cpu_build.HEADERS:
        shutil.copy(source, copy / source.name)
    here = cpu_build.build_directory()
    monkeypatch.setattr(cpu_build, "SOURCES", [copy / s.name for s in cpu_build.SOURCES])
    monkeypatch.setattr(cpu_build, "HEADERS", [copy / h.name for h in cpu_build.HEADERS])
    there = cpu_build.build_directory()
    assert there != here and there.parent == here.parent
    assert cpu_build.build_directory() == there  # the same checkout keeps its folder


def test_a_build_killed_half_way_does_not_block_later_loads(tmp_path):
    """torch's `lock` file left by a dead builder: the next process removes it (it holds the OS build lock, so no
    build is running) and loads the library instead of waiting forever."""
    built = cpu_build.build_directory()
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (copy / "lock").write_text("", encoding="utf-8")
    script = ("from radixserve.kernels import cpu_build; import sys; "
              "sys.exit(0 if cpu_build.load() and cpu_build.build_directory().name == sys.argv[1] else 1)")
    done = subprocess.run([sys.executable, "-c", script, built.name], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RADIXSERVE_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stale build lock" in done.stderr and not (copy / "lock").exists()


def test_a_library_built_before_loads_by_path_for_comparisons(tmp_path):
    """`load_library` (the benchmarks' `--library`): a fresh process runs a copy of a built library, not a build of
    its own (an empty cache folder stays empty), attends as the reference does, and refuses a second load."""
    library = tmp_path / "before.so"
    shutil.copy(next(cpu_build.build_directory().glob("*.so")), library)
    script = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from attention_cases import make_case, reference_attention
from radixserve.kernels import cpu_build
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan
from radixserve.model_runner.forward_batch import ForwardMode
cpu_build.load_library(sys.argv[1])
assert cpu_build.ready()
case = make_case(ForwardMode.DECODE, [40, 7], [1, 1], num_heads=9, num_kv_heads=3, head_dim=64, page_size=1,
                 dtype=torch.float32, seed=2)
backend = CpuAttentionBackend()
backend.plan(case.batch)
assert isinstance(case.batch.attn_metadata, CpuAttentionPlan)
out = backend.forward(case.q, case.k, case.v, case.layer_id, case.scaling, case.batch)
torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)
try:
    cpu_build.load_library(sys.argv[1])
except RuntimeError:
    print("refused")
"""
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-c", script, str(library), str(Path(__file__).parents[1])],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RADIXSERVE_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused"] and not cache.exists()


LONG_EXTENDS = [
    # (mode, prefix_lens, extend_lens)
    (ForwardMode.EXTEND, [0, 100, 0], [600, 300, 2]),
    (ForwardMode.MIXED, [40, 0, 200], [1, 400, 1]),  # a prefill chunk among decodes (--enable-mixed-chunk)
]


@pytest.mark.parametrize("mode,prefix_lens,extend_lens", LONG_EXTENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefills_run_on_the_kernel_by_default(dtype, mode, prefix_lens, extend_lens):
    assert MAX_KERNEL_EXTEND_LEN is None
    args = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=1, dtype=dtype, seed=4)
    case = make_case(mode, prefix_lens, extend_lens, **args)
    expected = reference_attention(case)
    out = run_backend(CpuAttentionBackend(), case)
    assert isinstance(case.batch.attn_metadata, CpuAttentionPlan) and kv_written(case)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    else:
        native = run_backend(TorchNativeAttention(), make_case(mode, prefix_lens, extend_lens, **args))
        error, native_error = (out.double() - expected).abs().max(), (native.double() - expected).abs().max()
        assert error <= 2 * native_error + 1e-3, (error, native_error)


def test_extends_longer_than_a_given_limit_run_on_torch_native():
    case = make_case(ForwardMode.EXTEND, [0, 3], [65, 2], num_heads=4, num_kv_heads=2, head_dim=16,
                     page_size=1, dtype=torch.float32, seed=2)
    out = run_backend(CpuAttentionBackend(max_extend_len=64), case)
    assert not isinstance(case.batch.attn_metadata, CpuAttentionPlan)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=2e-5, rtol=2e-5)
    short = make_case(ForwardMode.EXTEND, [0, 3], [64, 2], num_heads=4, num_kv_heads=2, head_dim=16,
                      page_size=1, dtype=torch.float32, seed=2)
    out = run_backend(CpuAttentionBackend(max_extend_len=64), short)
    assert isinstance(short.batch.attn_metadata, CpuAttentionPlan)
    torch.testing.assert_close(out.double(), reference_attention(short), atol=2e-5, rtol=2e-5)
