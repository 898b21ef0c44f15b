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
from radixserve.model_runner.attention.cpu_shared_packs import budget_from_env
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


@needs_amx
@pytest.mark.parametrize("max_group_tokens,copies", [(64, 1), (1024, 0)])
def test_an_extend_batch_copies_only_a_prefix_that_several_groups_read(max_group_tokens, copies):
    # Four requests extending by 32 tokens on one 64-token prefix: groups of at most 64 tokens are two groups
    # on that prefix (one copy, read twice); one group of 128 would read it once (no copy: gathering is cheaper).
    case = make_case(ForwardMode.EXTEND, [70] * 4, [32] * 4, num_heads=9, num_kv_heads=3, head_dim=64, page_size=1,
                     dtype=torch.bfloat16, seed=4)
    share_prefixes(case, 4, 64)
    backend = CpuAttentionBackend(max_group_tokens=max_group_tokens, max_extend_len=None)
    out = run_backend(backend, case)
    assert backend.shared_packs.num_built == copies and backend.shared_packs.num_reused == copies
    expected = run_backend(CpuAttentionBackend(max_group_tokens=max_group_tokens, max_extend_len=None,
                                               shared_pack_bytes=0), case)
    assert torch.equal(out, expected)


@needs_amx
def test_the_scheduler_decodes_the_same_tokens_with_copies_and_reused_slots_get_fresh_ones(default_model_dir):
    # The embedded model in bfloat16 through the real scheduler: two waves of requests, 2 groups of 4 on a 64-token
    # prefix each. Before each wave the cache is flushed and the allocator starts its free list over, so the second
    # wave's prefixes (other tokens) are written into the very slots the first wave's copies were made from.
    # Copies made at the first decode step are read at the next ones; greedy tokens equal those of the gathering
    # kernel in both waves (its output is bit-identical), so the second wave got fresh copies.
    from scheduler_driver import SchedulerDriver

    gen = torch.Generator().manual_seed(0)

    def wave():
        prompts = []
        for _ in range(2):
            prefix = torch.randint(100, 20000, (64,), generator=gen).tolist()
            prompts += [prefix + torch.randint(100, 20000, (8,), generator=gen).tolist() for _ in range(4)]
        return prompts

    waves = [wave(), wave()]
    driver = SchedulerDriver(default_model_dir, dtype="bfloat16", attention_backend="cpu", check_every_step=False)
    packs = driver.runner.attn_backend.shared_packs
    outputs = {}
    try:
        for budget in (packs.budget_bytes, 0):
            packs.budget_bytes = budget
            slot_lists = []
            for w, prompts in enumerate(waves):
                driver.flush_cache()
                allocator = driver.runner.allocator
                assert allocator.available_size() == allocator.size
                allocator.clear()
                for i, ids in enumerate(prompts):
                    driver.submit(f"{budget}-{w}-{i}", ids, max_new_tokens=6, ignore_eos=True)
                results = driver.run_until_idle()
                outputs[budget, w] = [results[f"{budget}-{w}-{i}"].output_ids for i in range(len(prompts))]
                slot_lists.append(sorted(slots.tolist() for slots in packs.prefixes()))
            if budget:
                assert packs.num_built > 0 and packs.num_reused > packs.num_built
                assert len(slot_lists[0]) == 2 and slot_lists[0] == slot_lists[1]
    finally:
        packs.budget_bytes = budget_from_env()
        driver.close()
    assert outputs[budget_from_env(), 0] == outputs[0, 0]
    assert outputs[budget_from_env(), 1] == outputs[0, 1]
    assert outputs[0, 0] != outputs[0, 1]
