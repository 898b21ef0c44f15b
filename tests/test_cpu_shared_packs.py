"""The packed copies of shared prefixes that the CPU attention kernel keeps across decode steps
(model_runner/attention/cpu_shared_packs.py): the same output as gathering from the pool, bit for bit; reused
only while they cannot be stale; within their memory budget.

They exist where the group path's shared keys run on AMX tiles (bfloat16 on a CPU with AMX-BF16); elsewhere the
kernel has no packed form and these tests check that none is made.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from attention_cases import make_case, reference_attention, run_backend, share_prefixes  # noqa: E402
from radixserve.kernels import cpu_build
from radixserve.model_runner.attention.cpu_backend import CpuAttentionBackend
from radixserve.model_runner.forward_batch import ForwardMode


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels cannot be built")
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"


def amx_machine() -> bool:
    return "amx_bf16" in cpu_build.cpu_isa().split(",")


needs_amx = pytest.mark.skipif(not amx_machine(), reason="packed copies are made for AMX tile products only")

# 18 decode requests: two groups of 8 on 100 shared positions (a partial last key tile), then a pair.
PREFIX_LENS, GROUP_SIZE, SHARED_LEN = [130] * 16 + [101, 140], 8, 100


def decode_case(dtype=torch.bfloat16, seed=5, head_dim=64):
    case = make_case(ForwardMode.DECODE, PREFIX_LENS, [1] * len(PREFIX_LENS), num_heads=9, num_kv_heads=3,
                     head_dim=head_dim, page_size=1, dtype=dtype, seed=seed)
    return share_prefixes(case, GROUP_SIZE, SHARED_LEN)


def gathered(case) -> torch.Tensor:
    """The kernel's output without packed copies (its shared keys gathered from the pool at the call)."""
    return run_backend(CpuAttentionBackend(shared_pack_bytes=0), case)


def rewrite_shared_keys(case, seed: int) -> None:
    """New K/V at the groups' shared slots (as when evicted slots are handed out again), reference copies too."""
    batch, gen = case.batch, torch.Generator().manual_seed(seed)
    rows = batch.req_pool_indices.tolist()
    slots = torch.cat([batch.req_to_token_pool.req_to_token[rows[g], :SHARED_LEN].long()
                       for g in range(0, 16, GROUP_SIZE)])
    for layer in range(len(batch.token_to_kv_pool.k_buffer)):
        for buffer in batch.token_to_kv_pool.get_kv_buffer(layer):
            buffer[slots] = torch.randn(buffer[slots].shape, generator=gen).to(buffer.dtype)
    share_prefixes(case, GROUP_SIZE, SHARED_LEN)  # refreshes the float64 copies of the prefixes


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_copies_give_the_gathered_output_at_every_step(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = decode_case()
        expected = gathered(case)
        backend = CpuAttentionBackend()
        for step in range(3):  # the first step makes the copies, the next ones read them
            out = run_backend(backend, case)
            assert torch.equal(out, expected), step
        packs = backend.shared_packs
        assert packs.num_packs == 2 and packs.num_built == 2  # the two groups of 8 (the pair reads in place)
        assert packs.num_reused == 4
        assert packs.reserved_bytes == 2 * 128 * 2 * 2 * 3 * 64 * 2  # 100 keys padded to 128, 2 layers, K and V
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_a_reused_slot_list_with_new_contents_gets_a_fresh_copy():
    case = decode_case()
    backend = CpuAttentionBackend()
    run_backend(backend, case)
    built = backend.shared_packs.num_built
    # The requests finish and their prefix's slots are freed and handed out again: the batch that writes them is
    # an extend batch, which keeps no copies. Then a decode batch has the same slot lists over new contents.
    extend = make_case(ForwardMode.EXTEND, [0, 40], [8, 3], num_heads=9, num_kv_heads=3, head_dim=64, page_size=1,
                       dtype=torch.bfloat16, seed=1)
    extend.batch.token_to_kv_pool = case.batch.token_to_kv_pool
    backend.plan(extend.batch)
    assert backend.shared_packs.num_packs == 0
    rewrite_shared_keys(case, seed=11)
    out = run_backend(backend, case)
    assert backend.shared_packs.num_built == built + 2
    assert torch.equal(out, gathered(case))
    error = (out.double() - reference_attention(case)).abs().max()
    assert error < 0.05, error  # and it is the attention of the new contents


@needs_amx
def test_another_pool_with_the_same_slots_gets_fresh_copies():
    first, second = decode_case(seed=5), decode_case(seed=5)  # same slots, separate pools
    rewrite_shared_keys(second, seed=12)
    backend = CpuAttentionBackend()
    run_backend(backend, first)
    out = run_backend(backend, second)
    assert torch.equal(out, gathered(second))


@needs_amx
def test_copies_a_batch_does_not_use_are_dropped():
    case = decode_case()
    backend = CpuAttentionBackend()
    run_backend(backend, case)
    assert backend.shared_packs.num_packs == 2
    lone = make_case(ForwardMode.DECODE, [50, 60], [1, 1], num_heads=9, num_kv_heads=3, head_dim=64, page_size=1,
                     dtype=torch.bfloat16, seed=2)
    lone.batch.token_to_kv_pool = case.batch.token_to_kv_pool  # same pool, no shared prefix
    run_backend(backend, lone)
    assert backend.shared_packs.num_packs == 0 and backend.shared_packs.reserved_bytes == 0


@needs_amx
def test_the_budget_bounds_the_copies():
    one_prefix = 128 * 2 * 2 * 3 * 64 * 2
    for budget, expected_packs in [(one_prefix - 1, 0), (one_prefix, 1), (2 * one_prefix, 2)]:
        case = decode_case()
        backend = CpuAttentionBackend(shared_pack_bytes=budget)
        out = run_backend(backend, case)
        assert backend.shared_packs.num_packs == expected_packs
        assert backend.shared_packs.reserved_bytes <= budget
        assert torch.equal(out, gathered(case))


@pytest.mark.parametrize("dtype,head_dim,amx", [(torch.float32, 64, "1"), (torch.bfloat16, 16, "1"),
                                                (torch.bfloat16, 64, "0")])
def test_no_copies_where_the_kernel_reads_the_pool_in_place(dtype, head_dim, amx, monkeypatch):
    # float32 keys and values are read in place, head_dim 16 is below a tile's 32, RADIXSERVE_CPU_AMX=0 keeps the
    # dot products: nothing to pack.
    monkeypatch.setenv("RADIXSERVE_CPU_AMX", amx)
    case = decode_case(dtype=dtype, head_dim=head_dim)
    backend = CpuAttentionBackend()
    out = run_backend(backend, case)
    assert backend.shared_packs.num_built == 0 and backend.shared_packs.num_packs == 0
    assert torch.equal(out, gathered(case))


@needs_amx
def test_the_kernel_rejects_a_copy_of_the_wrong_size():
    case = decode_case()
    backend = CpuAttentionBackend()
    backend.plan(case.batch)
    meta = case.batch.attn_metadata
    k_buffer, v_buffer = case.batch.token_to_kv_pool.get_kv_buffer(case.layer_id)
    short = torch.ops.radixserve_cpu.pack_shared_kv(k_buffer, v_buffer, meta.group_shared_slots[0][:64])
    packs = [short if slots is not None else torch.empty(0, dtype=torch.bfloat16)
             for slots in meta.group_shared_slots]
    with pytest.raises(RuntimeError, match="pack"):
        torch.ops.radixserve_cpu.paged_attention(
            case.q, k_buffer, v_buffer, case.k, case.v, meta.out_cache_loc, meta.items, meta.group_member_indptr,
            meta.group_kv_indptr, meta.member_q_start, meta.member_q_len, meta.member_q_pos0,
            meta.member_kv_indptr, meta.member_kv_pos0, meta.kv_slots, case.scaling, torch.empty(0), packs)
