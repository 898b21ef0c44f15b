"""Alternative kernels for the steps of the Llama-3.1-8B shape on the GPU, each measured on its own.

Six parts (all by default; name some to run only those):

- `gemm`: each projection (qkv, o, gate/up, down over 32 layers' weights, and the LM head) at 1-16 rows, cuBLAS
  (`torch.mm`) against FlashInfer's `tinygemm_bf16`, each captured in a CUDA graph, with the read floor from the
  measured copy bandwidth and the largest difference between the two outputs.
- `blas`: the same projections at 1 row to a prefill chunk of rows, through cuBLAS and through cuBLASLt (torch's
  preferred BLAS library), each captured in a CUDA graph, against the floor of their bytes at the copy bandwidth
  or their FLOPs at the rate of an 8192^3 product; then a whole 32-layer decode step through each.
- `attn`: one layer's decode attention (32 query heads, 8 KV heads, head_dim 128, bf16) for several batch x context
  shapes and pool layouts (`--attn-pools`: page size and NHD, a page's tokens outermost, or HND, its heads
  outermost): FlashInfer's tensor-core decode planned eagerly and for CUDA graphs, its FA3 backend (`--fa3`), and
  TensorRT-LLM's XQA kernel (pages of 16-128), each checked against the first.
- `extend`: one layer's attention of an extend batch (causal, pages of 1, over a cached prefix or none), FlashInfer's
  FA2 prefill kernels (the backend's) against its FA3 ones, with the achieved TFLOP/s.
- `two-stream`: a whole 32-layer decode step (RMSNorm, the four projections, FlashInfer decode attention, SiLU) in a
  CUDA graph: the full batch, its two halves one after the other, and the halves on two streams (so that one half's
  attention may overlap the other's matmuls), also with the second half started a layer late.
- `l2-prefetch`: the same step at small batches, and again with each layer's output-projection weight read into
  the L2 cache on a second stream while that layer's attention runs (a Triton kernel of `--prefetch-programs`
  programs), so that the projection reads it from L2 instead of HBM.

    python benchmarks/gpu_kernels.py --out docs/results/gpu_kernels_h200/gpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import roofline
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 4096, 14336, 32, 128256
PROJECTIONS = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
               "down": (HIDDEN, INTERMEDIATE)}
BF16 = torch.bfloat16


def time_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of `fn` over `repeats` back-to-back calls, by CUDA events."""
    for _ in range(warmup):
        fn()
    return roofline.time_ms(fn, torch.device("cuda"), calls=repeats)


def capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)


def gemm_part(rows_list: list[int]) -> dict:
    from flashinfer.gemm import tinygemm_bf16

    bandwidth = copy_bandwidth()
    weights = projection_weights()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'rows':>4} {'projection':>10} {'cuBLAS ms':>10} {'tinygemm ms':>12} {'floor ms':>9} {'max diff':>9}")
    result = {"bandwidth_tb_s": bandwidth / 1e12, "rows": {}}
    for rows in rows_list:
        row = {}
        for name, mats in weights.items():
            x = torch.randn(rows, mats[0].shape[1], dtype=BF16, device="cuda")
            out = torch.empty(rows, mats[0].shape[0], dtype=BF16, device="cuda")
            tinygemm_bf16(x, mats[0], out)
            diff = (out.float() - F.linear(x, mats[0]).float()).abs().max().item()

            def tiny(x=x, out=out, mats=mats):
                for weight in mats:
                    tinygemm_bf16(x, weight, out)

            a, b = time_ms(capture(products(x, out, mats)).replay), time_ms(capture(tiny).replay)
            floor = sum(w.numel() * 2 for w in mats) / bandwidth * 1e3
            row[name] = {"cublas_ms": a, "tinygemm_ms": b, "floor_ms": floor, "max_diff": diff}
            print(f"{rows:>4} {name:>10} {a:>10.3f} {b:>12.3f} {floor:>9.3f} {diff:>9.1e}")
        result["rows"][rows] = row
    return result


def blas_part(rows_list: list[int], steps: list[tuple[int, int]]) -> dict:
    libraries = ("cublas", "cublaslt")
    bandwidth = copy_bandwidth()
    cube = torch.randn(8192, 8192, dtype=BF16, device="cuda")
    rate = 2 * 8192**3 / (time_ms(lambda: cube @ cube, 10) / 1e3)
    del cube
    weights = projection_weights()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, 8192^3 product {rate / 1e12:.0f} TFLOP/s")
    print(f"{'rows':>5} {'projection':>10} {'cuBLAS ms':>10} {'cuBLASLt ms':>12} {'floor ms':>9} {'max diff':>9}")
    result = {"bandwidth_tb_s": bandwidth / 1e12, "matmul_tflop_s": rate / 1e12, "rows": {}, "steps": {}}
    for rows in rows_list:
        row = {}
        for name, mats in weights.items():
            if name == "lm_head" and rows > 1024:
                continue  # a prefill computes the logits of its last tokens only
            x = torch.randn(rows, mats[0].shape[1], dtype=BF16, device="cuda")
            out = torch.empty(rows, mats[0].shape[0], dtype=BF16, device="cuda")
            times, outs = {}, {}
            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                outs[library] = F.linear(x, mats[0])
                times[library] = time_ms(capture(products(x, out, mats)).replay)
            flops = 2 * rows * sum(w.numel() for w in mats)
            floor = max(sum(w.numel() * 2 for w in mats) / bandwidth, flops / rate) * 1e3
            diff = (outs["cublas"].float() - outs["cublaslt"].float()).abs().max().item()
            row[name] = {"cublas_ms": times["cublas"], "cublaslt_ms": times["cublaslt"], "floor_ms": floor,
                         "max_diff": diff}
            print(f"{rows:>5} {name:>10} {times['cublas']:>10.3f} {times['cublaslt']:>12.3f} {floor:>9.3f} "
                  f"{diff:>9.1e}")
        result["rows"][rows] = row
    print(f"{'batch':>5} {'context':>7} {'cuBLAS step ms':>15} {'cuBLASLt step ms':>17}")
    for batch, context in steps:
        k, v = random_kv(batch * context)
        step = HalfStep(weights, batch, context, k, v, 0)
        times = {}
        for library in libraries:
            torch.backends.cuda.preferred_blas_library(library)
            times[library] = time_ms(capture(step.forward).replay)
        result["steps"][f"{batch}x{context}"] = times
        print(f"{batch:>5} {context:>7} {times['cublas']:>15.3f} {times['cublaslt']:>17.3f}")
        del k, v, step
    torch.backends.cuda.preferred_blas_library("cublas")
    return result


def paged_case(batch: int, context: int, page: int, layout: str = "NHD"):
    pages_per_request = math.ceil(context / page)
    total = batch * pages_per_request
    shape = (total, page, KV_HEADS, HEAD_DIM) if layout == "NHD" else (total, KV_HEADS, page, HEAD_DIM)
    k = torch.randn(shape, dtype=BF16, device="cuda")
    v = torch.randn_like(k)
    indices = torch.randperm(total, device="cuda", dtype=torch.int32)
    indptr = torch.arange(0, batch + 1, dtype=torch.int32) * pages_per_request
    last = torch.full((batch,), context - (pages_per_request - 1) * page, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    return k, v, indices, indptr, last, q


def attention_part(shapes: list[tuple[int, int]], pools: list[tuple[int, str]], with_fa3: bool) -> dict:
    import flashinfer
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    scale = 1 / math.sqrt(HEAD_DIM)
    plan_args = dict(pos_encoding_mode="NONE", q_data_type=BF16, kv_data_type=BF16, sm_scale=scale)
    result = {}
    print(f"{'batch':>5} {'context':>7} {'pool':>8} {'kernel':>12} {'us':>8} {'TB/s':>6} {'max diff':>9}")
    for batch, context in shapes:
        for page, layout in pools:
            k, v, indices, indptr, last, q = paged_case(batch, context, page, layout)
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
            eager = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=True)
            eager.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, page, **plan_args)
            reference = eager.run(q, (k, v)).float()
            graph = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, layout, use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.clone(),
                paged_kv_last_page_len_buffer=last.cuda())
            graph.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, page, **plan_args)
            kernels = {"fa2 eager": lambda: eager.run(q, (k, v)), "fa2 graph": lambda: graph.run(q, (k, v))}
            if with_fa3:
                fa3 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=True,
                                                                    backend="fa3")
                fa3.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, page, **plan_args)
                kernels["fa3"] = lambda: fa3.run(q, (k, v))
            if 16 <= page <= 128:  # XQA takes pages of 16-128 tokens and a dense page table
                table = indices.view(batch, -1)
                lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                xqa_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
                kernels["xqa"] = lambda: trtllm_batch_decode_with_kv_cache(
                    q, (k, v), xqa_workspace, table, lens, context, bmm1_scale=scale, bmm2_scale=1.0,
                    kv_layout=layout, backend="xqa")
            cell = {}
            for name, fn in kernels.items():
                diff = (fn().float().reshape(reference.shape) - reference).abs().max().item()
                ms = time_ms(fn)
                cell[name] = {"us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9, "max_diff": diff}
                pool = f"{page}/{layout}"
                print(f"{batch:>5} {context:>7} {pool:>8} {name:>12} {ms * 1e3:>8.1f} {kv_bytes / ms / 1e9:>6.2f} "
                      f"{diff:>9.1e}")
            result[f"{batch}x{context}/page{page}" + ("" if layout == "NHD" else f"/{layout}")] = cell
            del k, v
            torch.cuda.empty_cache()
    return result


def extend_part(shapes: list[tuple[int, int, int]]) -> dict:
    import flashinfer

    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    result = {}
    print(f"{'batch':>5} {'new':>5} {'prefix':>6} {'backend':>7} {'us':>8} {'TFLOP/s':>8} {'max diff':>9}")
    for batch, new, prefix in shapes:
        length = prefix + new
        k = torch.randn(batch * length, 1, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda")
        v = torch.randn_like(k)
        indices = torch.randperm(batch * length, device="cuda", dtype=torch.int32)
        qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32) * new
        kv_indptr = torch.arange(0, batch + 1, dtype=torch.int32) * length
        last = torch.ones(batch, dtype=torch.int32)
        q = torch.randn(batch * new, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
        flops = 4 * HEADS * HEAD_DIM * batch * (new * prefix + new * (new + 1) // 2)
        cell, reference = {}, None
        for backend in ("fa2", "fa3"):
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
            wrapper.plan(qo_indptr, kv_indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, 1, causal=True,
                         pos_encoding_mode="NONE", q_data_type=BF16, kv_data_type=BF16, sm_scale=HEAD_DIM ** -0.5)
            out = wrapper.run(q, (k, v)).float()
            reference = out if reference is None else reference
            ms = time_ms(lambda: wrapper.run(q, (k, v)))
            diff = (out - reference).abs().max().item()
            cell[backend] = {"us": ms * 1e3, "tflop_s": flops / ms / 1e9, "max_diff": diff}
            print(f"{batch:>5} {new:>5} {prefix:>6} {backend:>7} {ms * 1e3:>8.1f} {flops / ms / 1e9:>8.1f} {diff:>9.1e}")
        result[f"{batch}x{new}+{prefix}"] = cell
        del k, v
        torch.cuda.empty_cache()
    return result


def projection_weights() -> dict[str, list[torch.Tensor]]:
    """`layer_weights()` and the LM head's."""
    weights = layer_weights()
    weights["lm_head"] = [torch.randn(VOCAB, HIDDEN, dtype=BF16, device="cuda") * 0.02]
    return weights


def products(x: torch.Tensor, out: torch.Tensor, mats: list[torch.Tensor]):
    """A function that multiplies `x` by each of `mats` (transposed) into `out` through torch's BLAS."""
    def run() -> None:
        for weight in mats:
            torch.mm(x, weight.t(), out=out)

    return run


def layer_weights() -> dict[str, list[torch.Tensor]]:
    """Random weights of each projection, one per layer."""
    return {name: [torch.randn(shape, dtype=BF16, device="cuda") * 0.02 for _ in range(LAYERS)]
            for name, shape in PROJECTIONS.items()}


def random_kv(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V for `slots` positions of one layer (pages of 1)."""
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    return k, torch.randn_like(k)


class HalfStep:
    """A 32-layer decode step of `batch` requests over its own slice of a shared KV buffer (pages of 1)."""

    def __init__(self, weights, batch: int, context: int, k, v, first_slot: int) -> None:
        import flashinfer

        self.weights, self.batch = weights, batch
        self.workspace = torch.zeros(768 << 20, dtype=torch.uint8, device="cuda")
        indptr = torch.arange(0, batch + 1, dtype=torch.int32) * context
        indices = torch.arange(batch * context, dtype=torch.int32, device="cuda") + first_slot
        last = torch.ones(batch, dtype=torch.int32)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr.cuda(),
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last.cuda())
        self.wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, 1, pos_encoding_mode="NONE",
                          q_data_type=BF16, kv_data_type=BF16, sm_scale=1 / math.sqrt(HEAD_DIM))
        self.x = torch.randn(batch, HIDDEN, dtype=BF16, device="cuda")
        self.kv = (k.view(-1, 1, KV_HEADS, HEAD_DIM), v.view(-1, 1, KV_HEADS, HEAD_DIM))

    def forward(self, after_attention=None, wait_for=None, prefetch=None) -> torch.Tensor:
        """`prefetch(weight)`, when given, runs on a side stream beside each layer's attention, given the output
        projection's weight."""
        x = self.x.clone()
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream() if prefetch is not None else None
        for layer in range(LAYERS):
            if wait_for is not None and layer < len(wait_for):
                current.wait_event(wait_for[layer])
            qkv = F.linear(F.rms_norm(x, (HIDDEN,)), self.weights["qkv"][layer])
            if side is not None:
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    prefetch(self.weights["o"][layer])
            attended = self.wrapper.run(qkv[:, : HEADS * HEAD_DIM].reshape(self.batch, HEADS, HEAD_DIM), self.kv)
            if after_attention is not None and layer < len(after_attention):
                after_attention[layer].record()
            if side is not None:
                current.wait_stream(side)
            x = x + F.linear(attended.reshape(self.batch, -1), self.weights["o"][layer])
            gate_up = F.linear(F.rms_norm(x, (HIDDEN,)), self.weights["gate_up"][layer])
            x = x + F.linear(F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:], self.weights["down"][layer])
        return x


def two_stream_part(shapes: list[tuple[int, int]]) -> dict:
    weights = layer_weights()
    result = {}
    print(f"{'batch':>5} {'context':>7} {'full ms':>8} {'halves in turn':>15} {'two streams':>12} {'late start':>11}")
    for batch, context in shapes:
        k, v = random_kv(batch * context)
        half = batch // 2
        full = HalfStep(weights, batch, context, k, v, 0)
        first = HalfStep(weights, half, context, k, v, 0)
        second = HalfStep(weights, batch - half, context, k, v, half * context)
        streams = (torch.cuda.Stream(), torch.cuda.Stream())

        def on_two_streams(late: bool) -> None:
            events = [torch.cuda.Event()] if late else None
            current = torch.cuda.current_stream()
            for stream in streams:
                stream.wait_stream(current)
            with torch.cuda.stream(streams[0]):
                first.forward(after_attention=events)
            with torch.cuda.stream(streams[1]):
                second.forward(wait_for=events)
            for stream in streams:
                current.wait_stream(stream)

        cell = {
            "full_ms": time_ms(capture(full.forward).replay, 10),
            "halves_in_turn_ms": time_ms(capture(lambda: (first.forward(), second.forward())).replay, 10),
            "two_streams_ms": time_ms(capture(lambda: on_two_streams(False)).replay, 10),
            "two_streams_late_start_ms": time_ms(capture(lambda: on_two_streams(True)).replay, 10),
        }
        result[f"{batch}x{context}"] = cell
        print(f"{batch:>5} {context:>7} {cell['full_ms']:>8.2f} {cell['halves_in_turn_ms']:>15.2f} "
              f"{cell['two_streams_ms']:>12.2f} {cell['two_streams_late_start_ms']:>11.2f}")
        del k, v, full, first, second
        torch.cuda.empty_cache()
    return result


def l2_prefetch_part(shapes: list[tuple[int, int]], programs_list: list[int]) -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def touch_kernel(src, n, out, BLOCK: tl.constexpr):
        """Reads src[0, n) (int32 words), program by program in strides, keeping the lines in L2."""
        pid, programs = tl.program_id(0), tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, programs * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            acc ^= tl.load(src + offsets, mask=offsets < n, other=0, eviction_policy="evict_last")
        tl.store(out + pid, tl.sum(acc))

    sink = torch.empty(max(programs_list), dtype=torch.int32, device="cuda")
    weights = layer_weights()
    result = {}
    print(f"{'batch':>5} {'context':>7} {'variant':>16} {'step ms':>8}")
    for batch, context in shapes:
        k, v = random_kv(batch * context)
        step = HalfStep(weights, batch, context, k, v, 0)
        cell = {"plain_ms": time_ms(capture(step.forward).replay, 20)}
        print(f"{batch:>5} {context:>7} {'plain':>16} {cell['plain_ms']:>8.3f}")
        for programs in programs_list:
            def prefetch(weight, programs=programs):
                words = weight.view(torch.int32).view(-1)
                touch_kernel[(programs,)](words, words.numel(), sink, BLOCK=2048)

            ms = time_ms(capture(lambda: step.forward(prefetch=prefetch)).replay, 20)
            cell[f"prefetch_{programs}_ms"] = ms
            print(f"{batch:>5} {context:>7} {f'prefetch x{programs}':>16} {ms:>8.3f}")
        result[f"{batch}x{context}"] = cell
        del k, v, step
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART",
                        help="gemm, blas, attn, extend, two-stream, l2-prefetch (default: all)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--blas-rows", type=int, nargs="+", default=[1, 8, 1000, 8192])
    parser.add_argument("--blas-steps", nargs="+", default=["1x1024", "1000x300"], help="blas: BATCHxCONTEXT")
    parser.add_argument("--extend-shapes", nargs="+", default=["32x256+0", "64x128+2048", "4x2176+0", "1x8192+0"],
                        help="extend batches as REQUESTSxNEW+PREFIX (the defaults: an 8,192-token chunk of 256-token "
                             "prompts; SGLang's generated-shared-prefix prompts, 128 new tokens on a cached 2,048-token "
                             "system prompt, and a group's first prompt; one long prompt)")
    parser.add_argument("--attn-pools", nargs="+", default=["16:NHD", "1:NHD"],
                        help="attn: pool layouts as PAGE:LAYOUT, LAYOUT NHD or HND")
    parser.add_argument("--attn-shapes", nargs="+", default=["1000x300", "1000x512", "1x1024", "64x1024", "256x1024"],
                        help="attn: BATCHxCONTEXT")
    parser.add_argument("--fa3", action="store_true", help="attn: also FlashInfer's FA3 backend as the decode")
    parser.add_argument("--prefetch-programs", type=int, nargs="+", default=[16, 32, 66, 132],
                        help="l2-prefetch: programs of the prefetch kernel, one variant each")
    parser.add_argument("--out", default=None, help="JSON record")
    args = parser.parse_args()
    known = ["gemm", "blas", "attn", "extend", "two-stream", "l2-prefetch"]
    if set(args.parts) - set(known):
        parser.error(f"unknown parts {sorted(set(args.parts) - set(known))}; choose from {known}")
    parts = args.parts or known
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "started": time.time()}
    if "gemm" in parts:
        record["gemm"] = gemm_part(args.rows)
        torch.cuda.empty_cache()
    if "blas" in parts:
        steps = [tuple(int(n) for n in shape.split("x")) for shape in args.blas_steps]
        record["blas"] = blas_part(args.blas_rows, steps)
        torch.cuda.empty_cache()
    if "attn" in parts:
        pools = [(int(pool.split(":")[0]), pool.split(":")[1]) for pool in args.attn_pools]
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.attn_shapes]
        record["attention"] = attention_part(shapes, pools, args.fa3)
    if "extend" in parts:
        shapes = []
        for shape in args.extend_shapes:
            requests, rest = shape.split("x")
            new, prefix = rest.split("+")
            shapes.append((int(requests), int(new), int(prefix)))
        record["extend"] = extend_part(shapes)
    if "two-stream" in parts:
        record["two_stream"] = two_stream_part([(1000, 300), (1000, 512), (512, 512), (256, 1024)])
    if "l2-prefetch" in parts:
        record["l2_prefetch"] = l2_prefetch_part([(1, 1024), (8, 1024), (32, 1024)], args.prefetch_programs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
