"""The Triton attention backend and the paged-KV index kernel against a float64 reference and torch_native.

Without a GPU the kernels run under the Triton interpreter. Triton decides interpreter-or-compiler when a
`@triton.jit` function is defined, and its own standard library (`tl.zeros`, `tl.max`, ...) is defined when
`triton` is first imported, so `TRITON_INTERPRET=1` must be in the environment before the first
`import triton` of the process: tests/conftest.py sets it on machines without a GPU (and this module
too, when run on its own without the conftest). On a GPU the kernels are compiled.
"""

from __future__ import annotations

import os
import sys

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from attention_cases import kv_written, make_case, reference_attention, run_backend  # noqa: E402
from radixserve.kernels import kv_indices, triton_attention  # noqa: E402
from radixserve.model_runner.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.model_runner.forward_batch import ForwardMode  # noqa: E402


def _interpreted(fn) -> bool:
    return isinstance(fn, InterpretedFunction)


RUNS_HERE = ON_GPU or all(
    _interpreted(fn)
    for fn in (tl.zeros, triton_attention._extend_kernel, triton_attention._decode_split_kernel,
               kv_indices._build_kv_indices_kernel)
)
DEVICE = "cuda" if ON_GPU else "cpu"
# tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU before anything imports triton.
assert RUNS_HERE, "triton was imported before TRITON_INTERPRET=1 was set: the kernels would not run"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 4e-2}

# (prefix_lens, extend_lens): empty prefixes, prefixes ending mid-page and on a page boundary, 1-token and
# long extends, a request longer than one kernel block.
EXTEND_BATCH = ([0, 7, 20, 16], [5, 19, 3, 1])
DECODE_BATCH = ([0, 13, 40, 3], [1, 1, 1, 1])
MIXED_BATCH = ([9, 0, 31], [1, 6, 1])


def _backend(num_heads: int, num_kv_heads: int, head_dim: int, max_kv_splits: int = 4) -> TritonAttentionBackend:
    return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, DEVICE, max_batch_size=8,
                                  max_kv_splits=max_kv_splits)


def _check_case(mode, lens, *, num_heads, num_kv_heads, head_dim, page_size, dtype=torch.float32, seed=0):
    case = make_case(mode, *lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, device=DEVICE, seed=seed)
    out = run_backend(_backend(num_heads, num_kv_heads, head_dim), case)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert kv_written(case)
    error = (out.double().cpu() - reference_attention(case)).abs().max().item()
    assert error < TOLERANCE[dtype], f"max abs error {error}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 2, 24), (2, 2, 32)])
def test_extend_with_cached_prefixes(page_size, num_heads, num_kv_heads, head_dim):
    _check_case(ForwardMode.EXTEND, EXTEND_BATCH, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, page_size=page_size)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 2, 24), (2, 2, 32)])
def test_decode(page_size, num_heads, num_kv_heads, head_dim):
    _check_case(ForwardMode.DECODE, DECODE_BATCH, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, page_size=page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_batch_runs_through_extend(page_size):
    _check_case(ForwardMode.MIXED, MIXED_BATCH, num_heads=4, num_kv_heads=1, head_dim=16, page_size=page_size)


@pytest.mark.parametrize("mode,lens", [(ForwardMode.EXTEND, EXTEND_BATCH), (ForwardMode.DECODE, DECODE_BATCH)])
def test_half_precision(mode, lens):
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    _check_case(mode, lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype, seed=3)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_decode_split_count_does_not_change_the_result(num_kv_splits):
    """Any number of shares, including shares longer than a request (empty ones) and a non-power of two."""
    case = make_case(ForwardMode.DECODE, [70, 0, 5], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                     page_size=1, dtype=torch.float32, device=DEVICE, seed=5)
    batch = case.batch
    batch.token_to_kv_pool.set_kv_buffer(case.layer_id, batch.out_cache_loc, case.k, case.v)
    k_buffer, v_buffer = batch.token_to_kv_pool.get_kv_buffer(case.layer_id)
    partial_out = torch.empty(3, 4, num_kv_splits, 16, device=DEVICE)
    partial_lse = torch.empty(3, 4, num_kv_splits, device=DEVICE)
    out = torch.empty_like(case.q)
    triton_attention.decode_attention(
        case.q, k_buffer, v_buffer, out, batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
        batch.seq_lens, case.scaling, partial_out, partial_lse, num_kv_splits,
    )
    assert (out.double().cpu() - reference_attention(case)).abs().max().item() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("mode,lens", [(ForwardMode.EXTEND, EXTEND_BATCH), (ForwardMode.DECODE, DECODE_BATCH),
                                       (ForwardMode.MIXED, MIXED_BATCH)])
def test_agrees_with_torch_native(mode, lens):
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32, device=DEVICE, seed=7)
    triton_out = run_backend(_backend(4, 2, 16), make_case(mode, *lens, **shape))
    native_out = run_backend(TorchNativeAttention(), make_case(mode, *lens, **shape))
    torch.testing.assert_close(triton_out, native_out, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,lens", [(ForwardMode.EXTEND, EXTEND_BATCH), (ForwardMode.DECODE, DECODE_BATCH)])
def test_strided_queries_and_custom_scaling(mode, lens):
    """q as a column slice of a fused QKV projection output, and a softmax scale other than 1/sqrt(d)."""
    case = make_case(mode, *lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32, device=DEVICE, seed=11)
    fused = torch.cat([case.q, case.k, case.v], dim=1)  # [tokens, 4 + 2 + 2, 16]
    case.q = fused[:, :4]
    assert not case.q.is_contiguous()
    case.scaling = 0.37
    out = run_backend(_backend(4, 2, 16), case)
    assert (out.double().cpu() - reference_attention(case)).abs().max().item() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_decode_merged_in_the_split_launch_leaves_the_counters_at_zero(num_kv_splits):
    """The shares are merged by each (request, KV head)'s last program: the reference's output, call after call on
    the shared counters, which each call leaves at zero for the next."""
    from radixserve.kernels.split_k import split_counters

    case = make_case(ForwardMode.DECODE, [70, 0, 5], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                     page_size=1, dtype=torch.float32, device=DEVICE, seed=5)
    batch = case.batch
    batch.token_to_kv_pool.set_kv_buffer(case.layer_id, batch.out_cache_loc, case.k, case.v)
    k_buffer, v_buffer = batch.token_to_kv_pool.get_kv_buffer(case.layer_id)
    for _ in range(2):
        out = torch.empty_like(case.q)
        triton_attention.decode_attention(
            case.q, k_buffer, v_buffer, out, batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
            batch.seq_lens, case.scaling, torch.empty(3, 4, num_kv_splits, 16, device=DEVICE),
            torch.empty(3, 4, num_kv_splits, device=DEVICE), num_kv_splits)
        assert (out.double().cpu() - reference_attention(case)).abs().max().item() < TOLERANCE[torch.float32]
        assert split_counters(case.q.device, 6).count_nonzero().item() == 0


class _Recording(TorchNativeAttention):
    """torch_native, counting its plans and whether it would rather run a decode batch eagerly."""

    def __init__(self, eager: bool = False) -> None:
        super().__init__()
        self.plans, self.eager = 0, eager

    def plan(self, batch):
        self.plans += 1
        super().plan(batch)

    def prefers_eager(self, batch):
        return self.eager


@pytest.mark.parametrize("mode,lens", [(ForwardMode.EXTEND, EXTEND_BATCH), (ForwardMode.DECODE, DECODE_BATCH),
                                       (ForwardMode.MIXED, MIXED_BATCH)])
@pytest.mark.parametrize("extend_prefers_eager", [False, True])
def test_hybrid_runs_decode_on_its_decode_backend(mode, lens, extend_prefers_eager):
    """Decode batches on the triton backend, the others (and a decode batch its extend backend would rather run
    eagerly, as FlashInfer's cascade does) on the extend backend; either way the reference's output."""
    from radixserve.model_runner.attention.hybrid import HybridAttentionBackend

    extend = _Recording(eager=extend_prefers_eager)
    hybrid = HybridAttentionBackend(extend, _backend(4, 2, 16))
    case = make_case(mode, *lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32,
                     device=DEVICE, seed=9)
    out = run_backend(hybrid, case)
    on_decode = mode == ForwardMode.DECODE and not extend_prefers_eager
    assert extend.plans == (0 if on_decode else 1)
    assert hybrid.prefers_eager(case.batch) == (mode == ForwardMode.DECODE and extend_prefers_eager)
    assert kv_written(case)
    assert (out.double().cpu() - reference_attention(case)).abs().max().item() < TOLERANCE[torch.float32]


def test_hybrid_keeps_larger_decode_batches_on_the_extend_backend():
    from radixserve.model_runner.attention.hybrid import HybridAttentionBackend

    extend = _Recording()
    hybrid = HybridAttentionBackend(extend, _backend(4, 2, 16), decode_max_batch=3)
    case = make_case(ForwardMode.DECODE, *DECODE_BATCH, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32, device=DEVICE, seed=2)
    assert case.batch.batch_size == 4
    out = run_backend(hybrid, case)
    assert extend.plans == 1
    assert (out.double().cpu() - reference_attention(case)).abs().max().item() < TOLERANCE[torch.float32]


def _reference_page_table(req_to_token, rows, seq_lens, page_size, starts=None):
    indptr, indices, last = [0], [], []
    for i, (row, seq_len) in enumerate(zip(rows, seq_lens)):
        start = 0 if starts is None else starts[i]
        num_pages = -(-seq_len // page_size)
        indices += (req_to_token[row, start:seq_len:page_size].long() // page_size).tolist()
        indptr.append(indptr[-1] + num_pages - start // page_size)
        last.append(seq_len - (num_pages - 1) * page_size)
    return indptr, indices, last


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_index_kernel(page_size):
    prefix_lens, extend_lens = [0, 15, 16, 40, 3], [1, 1, 20, 9, 200]
    case = make_case(ForwardMode.EXTEND, prefix_lens, extend_lens, num_heads=1, num_kv_heads=1, head_dim=16,
                     page_size=page_size, dtype=torch.float32, device=DEVICE)
    batch = case.batch
    req_to_token = batch.req_to_token_pool.req_to_token
    index = kv_indices.build_paged_kv_index(req_to_token, batch.req_pool_indices, batch.seq_lens,
                                            batch.seq_lens_cpu, page_size)
    rows = batch.req_pool_indices.tolist()
    indptr, indices, last = _reference_page_table(req_to_token.cpu(), rows, batch.seq_lens_cpu, page_size)
    assert index.indptr.tolist() == indptr == index.indptr_host.tolist()
    assert index.indices.tolist() == indices
    assert index.last_page_len.tolist() == last == index.last_page_len_host.tolist()
    assert index.indices.dtype == index.indptr.dtype == index.last_page_len.dtype == torch.int32
    # The page table addresses exactly the request's slots: position p is at page_ids[p // P] * P + p % P.
    for i, (row, seq_len) in enumerate(zip(rows, batch.seq_lens_cpu)):
        pages = torch.tensor(indices[indptr[i]:indptr[i + 1]])
        positions = torch.arange(seq_len)
        expected = pages[positions // page_size] * page_size + positions % page_size
        assert torch.equal(expected, req_to_token[row, :seq_len].long().cpu())


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_kv_index_from_given_starts(page_size):
    """The table of the keys after a shared prefix (cascade attention's per-request level)."""
    prefix_lens, extend_lens = [0, 15, 16, 40, 3], [1, 1, 20, 9, 200]
    starts = [0, 12, 16, 36, 0]
    case = make_case(ForwardMode.EXTEND, prefix_lens, extend_lens, num_heads=1, num_kv_heads=1, head_dim=16,
                     page_size=page_size, dtype=torch.float32, device=DEVICE)
    batch = case.batch
    req_to_token = batch.req_to_token_pool.req_to_token
    index = kv_indices.build_paged_kv_index(req_to_token, batch.req_pool_indices, batch.seq_lens,
                                            batch.seq_lens_cpu, page_size, starts_host=starts)
    rows = batch.req_pool_indices.tolist()
    indptr, indices, last = _reference_page_table(req_to_token.cpu(), rows, batch.seq_lens_cpu, page_size, starts)
    assert index.indptr.tolist() == indptr == index.indptr_host.tolist()
    assert index.indices.tolist() == indices
    assert index.last_page_len.tolist() == last == index.last_page_len_host.tolist()
    if page_size > 1:
        with pytest.raises(AssertionError, match="whole pages"):
            kv_indices.build_paged_kv_index(req_to_token, batch.req_pool_indices, batch.seq_lens,
                                            batch.seq_lens_cpu, page_size, starts_host=[1, 0, 0, 0, 0])


# (mode, prefix_lens, extend_lens, window): windows shorter than the prefixes and than the extends (so rows of one
# query block start their windows in different key blocks), a window of one position.
WINDOW_CASES = [
    (ForwardMode.DECODE, [0, 13, 40, 3], [1, 1, 1, 1], 8),
    (ForwardMode.DECODE, [70], [1], 1),
    (ForwardMode.EXTEND, [0, 7, 20, 16], [5, 19, 3, 1], 6),
    (ForwardMode.EXTEND, [0], [40], 3),
    (ForwardMode.MIXED, [9, 0, 31], [1, 6, 1], 4),
]


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", WINDOW_CASES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_sliding_window(mode, prefix_lens, extend_lens, window, page_size):
    """A windowed layer against the float64 reference with the window's mask; the positions no query sees point at
    NaN, so a kernel that reads one fails."""
    from attention_cases import poison_outside_windows

    case = make_case(mode, prefix_lens, extend_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=page_size,
                     dtype=torch.float32, device=DEVICE, seed=window)
    expected = reference_attention(case, sliding_window=window)
    poison_outside_windows(case, window)
    out = run_backend(_backend(4, 2, 16), case, window)
    error = (out.double().cpu() - expected).abs().max().item()
    assert error < TOLERANCE[torch.float32], f"max abs error {error}"


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,window", [c for c in WINDOW_CASES if c[3] > 1])
def test_sliding_window_reads_and_writes_window_slots(mode, prefix_lens, extend_lens, window):
    """A window layer whose KV sits in a slot space of its own (radix_cache/swa_pool.py): the kernels read it through
    the batch's rows translated into window slots, and the new K/V go to their window slots."""
    from attention_cases import with_window_slots

    case = make_case(mode, prefix_lens, extend_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
                     dtype=torch.float32, device=DEVICE, seed=window)
    expected = reference_attention(case, sliding_window=window)
    with_window_slots(case, window, seed=len(prefix_lens))
    out = run_backend(_backend(4, 2, 16), case, window)
    error = (out.double().cpu() - expected).abs().max().item()
    assert error < TOLERANCE[torch.float32], f"max abs error {error}"
    assert kv_written(case)


@pytest.mark.parametrize("splits,window", [(1, None), (4, None), (8, 9), (16, None)])
def test_decode_writes_the_new_kv_in_its_own_launch(splits, window):
    """`decode_attention(..., new_kv=(k, v, loc))` equals `store_kv` then `decode_attention`, bit for bit, in the
    output and in both buffers: requests of 1 to 300 positions (shares with and without the last position, empty
    shares), a value view strided as a slice of a fused qkv, grouped heads."""
    from radixserve.kernels.kv_store import store_kv

    generator = torch.Generator().manual_seed(splits)
    dtype = torch.float16 if not ON_GPU else torch.bfloat16
    lens, heads, kv_heads, dim = [1, 40, 300, 7], 8, 2, 64
    batch, slots = len(lens), sum(lens) + 8
    k_buffer = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype).to(DEVICE)
    v_buffer = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype).to(DEVICE)
    order = (torch.randperm(slots - 1, generator=generator) + 1).tolist()
    req_to_token = torch.zeros(batch, max(lens), dtype=torch.int32)
    for row, length in enumerate(lens):
        req_to_token[row, :length] = torch.tensor(order[:length])
        order = order[length:]
    loc = torch.tensor([int(req_to_token[row, length - 1]) for row, length in enumerate(lens)]).to(DEVICE)
    req_to_token = req_to_token.to(DEVICE)
    q = torch.randn(batch, heads, dim, generator=generator).to(dtype).to(DEVICE)
    new_k = torch.randn(batch, kv_heads, dim, generator=generator).to(dtype).to(DEVICE)
    qkv = torch.randn(batch, 3 * kv_heads * dim, generator=generator).to(dtype).to(DEVICE)
    new_v = qkv[:, kv_heads * dim:2 * kv_heads * dim].view(batch, kv_heads, dim)
    rows, seq_lens = torch.arange(batch, device=DEVICE), torch.tensor(lens, device=DEVICE)
    results = []
    for fused in (False, True):
        keys, values, out = k_buffer.clone(), v_buffer.clone(), torch.empty_like(q)
        partial_out = torch.empty(batch, heads, splits, dim, device=DEVICE)
        partial_lse = torch.empty(batch, heads, splits, device=DEVICE)
        if not fused:
            store_kv(keys, values, loc, new_k, new_v)
        triton_attention.decode_attention(q, keys, values, out, req_to_token, rows, seq_lens, dim ** -0.5,
                                          partial_out, partial_lse, splits, window,
                                          new_kv=(new_k, new_v, loc) if fused else None)
        results.append((out, keys, values))
    (out, keys, values), (fused_out, fused_keys, fused_values) = results
    assert torch.equal(fused_out, out) and torch.equal(fused_keys, keys) and torch.equal(fused_values, values)
    assert torch.equal(fused_keys[loc], new_k) and torch.equal(fused_values[loc], new_v)


@pytest.mark.parametrize("store_new_kv", [False, True])
def test_backend_decode_writes_the_new_kv_either_way(store_new_kv, monkeypatch):
    """The backend's decode with the kernel writing the new K/V (the default) and with the pool writing them first:
    both leave them at their slots and match the float64 reference."""
    monkeypatch.setattr(TritonAttentionBackend, "store_new_kv", store_new_kv)
    _check_case(ForwardMode.DECODE, DECODE_BATCH, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1)
