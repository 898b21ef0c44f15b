"""The skinny decode GEMMs' compiled cost, without a GPU: each FMA kernel (kernels/w4a16_gemm.py,
kernels/fp8_skinny_gemm.py) compiled for a CUDA target by Triton on this host, its K loop read from the SASS.

    python benchmarks/skinny_sass.py        # sm_90: the FMA configs each kernel picks at one row of Llama-3.1-8B
    python benchmarks/skinny_sass.py --kinds w4a16 --configs 64x128x4,128x128x4

At one row a product's floor is its weight's bytes over the memory bandwidth, and a kernel stays near it only while
its instructions issue faster than the bytes arrive: an H100 SM issues 4 warp instructions a cycle, so streaming
3 TB/s over 132 SMs at about 1.75 GHz leaves about 4.9 instructions a weight for half-byte (4-bit) weights, 9.8 for
FP8 and 19.6 for 16-bit ones. For each kernel and tile the script prints the loop's SASS instructions per weight (a
program's loop body over the weights one thread holds in an iteration), the registers a thread uses (which bound the
programs an SM holds) and the opcodes that dominate. Integer arguments are compiled as Triton specializes them at
run time for these shapes (multiples of 16), so the loads vectorize as on the GPU.

Needs the CUDA tools Triton ships (ptxas, nvdisasm, cuobjdump), not a GPU. Writes a JSON record (--out, or
$OUT/skinny_sass.json when OUT is set).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from _srcpath import ROOT  # noqa: F401  (maps radixserve.<folder> onto the checkout)
# after triton: imported first, tune_w4a16 would set the interpreter on a CPU host
from tune_w4a16 import LLAMA_8B_SHAPES, parse_dims


def picked_configs(kind: str) -> list[tuple[int, int, int]]:
    """(block_n, block_k, num_warps) of the FMA configs `kind`'s kernel picks at one row of Llama-3.1-8B's
    projections (the tensor-core ones left out), in shape order, each once."""
    from radixserve.kernels.fp8_skinny_gemm import fp8_skinny_config, skinny_16bit_config
    from radixserve.kernels.w4a16_gemm import skinny_config

    # An H100's 132 SMs: the SM count sets only the split, not the tile compiled here.
    pick = {"w4a16": lambda n, k: skinny_config(1, n, k, 128, False, 132),
            "fp8": lambda n, k: fp8_skinny_config(1, n, k, None, 132),
            "bf16": lambda n, k: skinny_16bit_config(1, n, k, 132)}[kind]
    configs = [pick(n, k) for n, k in parse_dims(LLAMA_8B_SHAPES)]
    return list(dict.fromkeys((c.block_n, c.block_k, c.num_warps) for c in configs if not c.use_dot))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_fma_kernel(kind: str, block_n: int, block_k: int, warps: int, arch: int) -> bytes:
    """The cubin of one FMA kernel: `w4a16` (GPTQ words, groups of 128, no g_idx), `fp8` or `bf16` weights."""
    if kind == "w4a16":
        from radixserve.kernels.w4a16_gemm import _w4a16_fma_kernel as kernel

        pointers = dict(X="*bf16", QWeight="*i32", Scales="*bf16", Zeros="*bf16", GIdx="*i32", Out="*bf16",
                        Partial="*fp32", Counters="*i32")
        constants = dict(HAS_G_IDX=False, GROUP_SIZE=128, EVEN_K=True, SPLIT=True)
    else:
        from radixserve.kernels.fp8_skinny_gemm import _w8a16_fma_kernel as kernel

        pointers = dict(X="*bf16", W="*fp8e4nv" if kind == "fp8" else "*bf16", Scale="*fp32", Out="*bf16",
                        Partial="*fp32", Counters="*i32")
        constants = dict(BLOCK_SCALES=False, GROUP_N=1, GROUP_K=1, EVEN_K=True, HAS_SCALE=kind == "fp8", SPLIT=True)
    constants.update(BLOCK_N=block_n, BLOCK_K=block_k)
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constants else pointers.get(p, "i32") for p in params}
    # Every pointer and integer but the row count is a multiple of 16 at these shapes, as Triton specializes them.
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in constants and p != "M"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=3))
    return compiled.asm["cubin"]


def loop_cost(cubin: bytes) -> tuple[int, collections.Counter, int]:
    """(instructions in the longest loop, their opcodes, registers per thread) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], check=True, capture_output=True, text=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], check=True, capture_output=True,
                               text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        code = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if code:
            address = int(code.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append((address, code.group(2).strip()))
    body: list[str] = []
    for address, text in instructions:  # a loop: a branch back to a label before it
        target = re.search(r"BRA\s.*\.L_x_(\d+)", text)
        if target and labels.get(target.group(1), address + 1) < address:
            start = labels[target.group(1)]
            candidate = [t for a, t in instructions if start <= a <= address]
            body = candidate if len(candidate) > len(body) else body
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return len(body), opcodes, registers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="w4a16,fp8,bf16")
    parser.add_argument("--configs", help="block_n x block_k x warps, comma separated (default: the picked ones)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for an H100 / H200")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                      "skinny_sass.json"))
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    print(f"{'kernel':<7} {'tile':>11} {'loop':>6} {'/weight':>8} {'regs':>5}  top opcodes")
    rows = []
    for kind in args.kinds.split(","):
        configs = parse_dims(args.configs) if args.configs else picked_configs(kind)
        for block_n, block_k, warps in configs:
            config = f"{block_n}x{block_k}x{warps}"
            length, opcodes, registers = loop_cost(compile_fma_kernel(kind, block_n, block_k, warps, args.arch))
            weights = block_n * block_k // (32 * warps)  # a thread's share of the tile, one loop iteration
            top = ", ".join(f"{op} {count}" for op, count in opcodes.most_common(6))
            print(f"{kind:<7} {config:>11} {length:>6} {length / weights:>8.2f} {registers:>5}  {top}")
            rows.append(dict(kernel=kind, block_n=block_n, block_k=block_k, num_warps=warps, loop_instructions=length,
                             instructions_per_weight=length / weights, registers=registers, opcodes=dict(opcodes)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "skinny_sass", "triton": triton.__version__, "arch": args.arch, "rows": rows}, f,
                  indent=2)


if __name__ == "__main__":
    main()
