"""The triton backend's split-KV decode kernel (kernels/triton_attention.py) on the GPU, by its tile, warps and split
count, beside FlashInfer's decode as the attention backend captures it (page size 1, tensor cores from four query
heads a KV head, a CUDA-graph wrapper), both in CUDA graphs.

A decode step reads each layer's keys and values once, from memory: each timed graph runs one call per layer of
`--layers` separate KV buffers (so L2 holds none of the next call's), and the figure is the graph's median time over
the layers. Every config's output is checked against FlashInfer's (bfloat16 tolerance) before it is timed.

    python benchmarks/decode_attention_gpu.py --heads 32,4 --batch-sizes 1,8,64 --context-len 1024
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)
from cuda_graph_timing import time_graph


def graph_us(fn, layers: int, repeats: int = 20) -> float:
    """Median microseconds per layer of one CUDA graph of `fn(layer)` over every layer."""
    return time_graph([lambda layer=layer: fn(layer) for layer in range(layers)], repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="32,4", help="query heads, KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--splits", default="8,16,32")
    parser.add_argument("--block-n", default="16,32,64")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                      "decode_attention_gpu.json"))
    args = parser.parse_args()
    from radixserve.kernels import flashinfer_wrappers as fi
    from radixserve.kernels.kv_indices import build_paged_kv_index
    from radixserve.kernels.triton_attention import decode_attention

    num_heads, num_kv_heads = (int(v) for v in args.heads.split(","))
    dim, context, device, dtype = args.head_dim, args.context_len, torch.device("cuda"), torch.bfloat16
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}; {num_heads} query / {num_kv_heads} KV heads of {dim}, context {context}, {args.layers} layers")
    print(f"{'batch':>5} {'flashinfer us':>13} {'triton us':>9} {'best/fi':>7}  best (splits, block_n, warps)")
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        slots = batch * context + 1
        generator = torch.Generator(device=device).manual_seed(batch)
        keys = [torch.randn(slots, num_kv_heads, dim, device=device, dtype=dtype, generator=generator)
                for _ in range(args.layers)]
        values = [torch.randn(slots, num_kv_heads, dim, device=device, dtype=dtype, generator=generator)
                  for _ in range(args.layers)]
        q = torch.randn(batch, num_heads, dim, device=device, dtype=dtype, generator=generator)
        # Request i holds slots 1 + i * context ... in a shuffled order (the pool's scattered free list).
        req_to_token = (1 + torch.randperm(batch * context, device=device, generator=generator)).view(batch, context)
        req_to_token = req_to_token.to(torch.int32)
        rows_ = torch.arange(batch, device=device)
        seq_lens = torch.full((batch,), context, device=device, dtype=torch.int64)
        scale = dim ** -0.5
        flashinfer = fi.require_flashinfer()
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(  # as the backend captures it: fixed index buffers
            fi.new_workspace(device), "NHD", use_cuda_graph=True, use_tensor_cores=num_heads // num_kv_heads >= 4,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(batch * context, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.ones(batch, dtype=torch.int32, device=device))
        index = build_paged_kv_index(req_to_token, rows_, seq_lens, [context] * batch, 1)
        fi.plan_decode(wrapper, index, num_heads, num_kv_heads, dim, 1, dtype, dtype, scale)
        reference = fi.run_paged(wrapper, q, keys[0], values[0], 1).float()
        try:
            fi_us = graph_us(lambda layer: fi.run_paged(wrapper, q, keys[layer], values[layer], 1), args.layers)
        except RuntimeError as exc:  # a wrapper not made for capture: the table says so, the sweep goes on
            print(f"  flashinfer in a graph failed: {exc}")
            fi_us = float("nan")
        best, best_us = None, float("inf")
        for splits, block_n, warps in itertools.product(*(map(int, v.split(",")) for v in
                                                          (args.splits, args.block_n, args.warps))):
            partial_out = torch.empty(batch, num_heads, splits, dim, device=device)
            partial_lse = torch.empty(batch, num_heads, splits, device=device)
            out = torch.empty_like(q)

            def call(layer, splits=splits, block_n=block_n, warps=warps, partial_out=partial_out,
                     partial_lse=partial_lse, out=out):
                decode_attention(q, keys[layer], values[layer], out, req_to_token, rows_, seq_lens, scale,
                                 partial_out, partial_lse, splits, block_n=block_n, num_warps=warps)

            call(0)
            error = (out.float() - reference).abs().max().item()
            if error > 2e-2:
                print(f"  splits {splits} block_n {block_n} warps {warps}: max error {error:.3g}, skipped")
                continue
            us = graph_us(call, args.layers)
            rows.append(dict(batch=batch, splits=splits, block_n=block_n, warps=warps, us=us, flashinfer_us=fi_us))
            if us < best_us:
                best, best_us = (splits, block_n, warps), us
        print(f"{batch:>5} {fi_us:>13.2f} {best_us:>9.2f} {best_us / fi_us:>7.2f}  {best}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "decode_attention_gpu", "gpu": gpu, "args": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
