"""Builds FlashInfer's paged-KV page table (indptr / indices / last_page_len) on the device.

Request i owns `num_pages[i] = ceil(seq_lens[i] / page_size)` pages. Its k-th page is the page that
holds position `k * page_size`: `req_to_token[row, k * page_size] // page_size`. With `starts`, a table lists
only the pages from position `starts[i]` (a multiple of the page size) on: the keys after a shared prefix that
cascade attention reads separately. This relies on the pool's
layout rule that a request's positions are page-aligned (position p sits at offset `p % page_size` of its
page: cached prefixes are whole pages and a request's own tokens fill its pages in order), so with
`page_size == 1` the indices are exactly the token slots.

On a machine without CUDA the kernel runs only under the Triton interpreter (`TRITON_INTERPRET=1` set
before `triton` is first imported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _build_kv_indices_kernel(
    Req_to_token, Req_pool_indices, Seq_lens, Starts, Kv_indptr, Kv_indices, Kv_last_page_len,
    stride_r2t_row,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, HAS_STARTS: tl.constexpr,
):
    """One program per request: copy the first slot of each of its pages (from its start on), divided by the
    page size, into its range of Kv_indices, and write how many positions its last page holds."""
    req = tl.program_id(0)
    row = tl.load(Req_pool_indices + req).to(tl.int64)
    seq_len = tl.load(Seq_lens + req).to(tl.int32)
    out_start = tl.load(Kv_indptr + req).to(tl.int64)
    num_pages = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE
    first_page = 0
    if HAS_STARTS:
        first_page = tl.load(Starts + req).to(tl.int32) // PAGE_SIZE
    for block_start in range(0, num_pages - first_page, BLOCK):
        pages = block_start + tl.arange(0, BLOCK)
        mask = pages < num_pages - first_page
        first_slots = tl.load(Req_to_token + row * stride_r2t_row + (first_page + pages) * PAGE_SIZE, mask=mask,
                              other=0)
        tl.store(Kv_indices + out_start + pages, (first_slots // PAGE_SIZE).to(tl.int32), mask=mask)
    tl.store(Kv_last_page_len + req, (seq_len - (num_pages - 1) * PAGE_SIZE).to(tl.int32))


@dataclass
class PagedKVIndex:
    """One batch's page table. Device tensors feed the kernels; the host mirrors (computed from the
    batch's host-side lengths, never copied back from the device) let FlashInfer plan without a sync."""

    indptr: torch.Tensor  # [batch + 1] int32, device
    indices: torch.Tensor  # [indptr[-1]] int32, device: page ids
    last_page_len: torch.Tensor  # [batch] int32, device: 1..page_size
    indptr_host: torch.Tensor  # [batch + 1] int32, CPU
    last_page_len_host: torch.Tensor  # [batch] int32, CPU


def build_paged_kv_index(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Sequence[int],
    page_size: int,
    starts_host: Optional[Sequence[int]] = None,
) -> PagedKVIndex:
    """The page table of requests `req_pool_indices` (rows of `req_to_token`) with lengths `seq_lens`
    (a device tensor, mirrored by `seq_lens_host`), from position `starts_host[i]` on (default 0; multiples of
    the page size). Every request must keep at least one position."""
    assert page_size >= 1 and len(seq_lens_host) == int(req_pool_indices.shape[0])
    device = req_to_token.device
    batch = len(seq_lens_host)
    host_lens = torch.tensor(list(seq_lens_host), dtype=torch.int32)
    host_pages = (host_lens + page_size - 1) // page_size
    device_pages = (seq_lens + page_size - 1) // page_size
    host_first_pages, starts = torch.zeros(batch, dtype=torch.int32), None
    if starts_host is not None:
        host_starts = torch.tensor(list(starts_host), dtype=torch.int32)
        assert bool((host_starts % page_size == 0).all()), "starts must be whole pages"
        host_first_pages = host_starts // page_size
        starts = host_starts.to(device, non_blocking=True)
        device_pages = device_pages - starts // page_size
    assert bool((host_lens > host_first_pages * page_size).all()), "every request needs at least one position"
    indptr_host = torch.zeros(batch + 1, dtype=torch.int32)
    indptr_host[1:] = torch.cumsum(host_pages - host_first_pages, dim=0)
    last_page_len_host = host_lens - (host_pages - 1) * page_size

    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(device_pages, dim=0)
    indices = torch.empty(int(indptr_host[-1]), dtype=torch.int32, device=device)
    last_page_len = torch.empty(batch, dtype=torch.int32, device=device)
    if batch > 0:
        _build_kv_indices_kernel[(batch,)](
            req_to_token, req_pool_indices, seq_lens, starts if starts is not None else seq_lens, indptr, indices,
            last_page_len, req_to_token.stride(0),
            PAGE_SIZE=page_size, BLOCK=128, HAS_STARTS=starts is not None,
        )
    return PagedKVIndex(indptr, indices, last_page_len, indptr_host, last_page_len_host)
