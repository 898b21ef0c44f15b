"""Block sizes of the fused MoE kernels (kernels/fused_moe_triton.py), per layer shape and token count.

`TUNED` maps a layer shape, `(experts, intermediate per rank, hidden, dtype)`, to rows `(max_tokens, config)` in
increasing `max_tokens`: a call with T tokens takes the first row with `T <= max_tokens` (the last row beyond). Shapes
without an entry take `DEFAULTS`, chosen the same way. A config names the kernels' tile (`BLOCK_M` rows of (token,
expert) pairs, which is also the alignment of each expert's run; `BLOCK_N` output columns; `BLOCK_K` of the reduced
dimension), `num_warps` and `num_stages`.

The defaults follow the shape of the problem: at decode sizes an expert sees a handful of pairs, so a short `BLOCK_M`
wastes little on padding and a wide `BLOCK_K` streams the weight; at prefill sizes each expert's run fills taller tiles.
Rows for a shape are measured by benchmarks/tune_fused_moe.py on the GPU their comment names, and kept only where the
search matched the default config's output.

The decode path (a few pairs, no alignment) has one config per layer shape, `DECODE_TUNED`, else `DECODE_DEFAULT`:
`BLOCK_N` intermediate columns per gate/up program and `BLOCK_K` of H per step; `DOWN_BLOCK_N` hidden columns per down
program and `DOWN_BLOCK_K` of I per step (of every slot at once). Its grids are pairs x I / BLOCK_N and tokens x H /
DOWN_BLOCK_N, so at one token of Qwen3-30B-A3B (top-8, I 768, H 2048) the defaults give 48 x 8 and 1024 programs, a
few per SM, each streaming rows of contiguous weights.
"""

from __future__ import annotations

from typing import Optional

BlockConfig = dict[str, int]

DEFAULTS: list[tuple[int, BlockConfig]] = [
    (32, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}),
    (512, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
    (1 << 62, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
]

# (experts, intermediate per rank, hidden, dtype name) -> [(max_tokens, config), ...]
TUNED: dict[tuple[int, int, int, str], list[tuple[int, BlockConfig]]] = {
    # Qwen3-30B-A3B at TP 1; NVIDIA H100 80GB HBM3, 2026-12-06 (docs/results/tune_fused_moe_h100.json)
    (128, 768, 2048, "bfloat16"): [
        (7, {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}),
        (63, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}),
        (255, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
        (1023, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}),
        (4095, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
        (1 << 62, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
    ],
}


DECODE_DEFAULT: BlockConfig = {"BLOCK_N": 16, "BLOCK_K": 256, "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 256, "num_warps": 4,
                               "num_stages": 3}

# (experts, intermediate per rank, hidden, dtype name) -> the decode path's config
DECODE_TUNED: dict[tuple[int, int, int, str], BlockConfig] = {
    # NVIDIA H100 80GB HBM3: Qwen3-30B-A3B's layer, 1 token 42.4 -> 38.4 us a call in CUDA graphs (gate/up); the
    # down kernel over all slots at once, alone in CUDA graphs over 8 layers' weights: 1 token 15.9 -> 11.8 us, 8
    # tokens 68.3 -> 57.1 us
    (128, 768, 2048, "bfloat16"): {"BLOCK_N": 16, "BLOCK_K": 512, "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 256,
                                   "num_warps": 4, "num_stages": 3},
}


def decode_config(num_experts: int, intermediate: int, hidden: int, dtype_name: str) -> BlockConfig:
    """The decode path's config for this layer shape (a copy)."""
    return dict(DECODE_TUNED.get((num_experts, intermediate, hidden, dtype_name), DECODE_DEFAULT))


def block_config(num_tokens: int, num_experts: int, intermediate: int, hidden: int, dtype_name: str,
                 table: Optional[dict] = None) -> BlockConfig:
    """The config for a call on `num_tokens` tokens of this layer shape (a copy: callers may adjust it)."""
    rows = (TUNED if table is None else table).get((num_experts, intermediate, hidden, dtype_name), DEFAULTS)
    for max_tokens, config in rows:
        if num_tokens <= max_tokens:
            return dict(config)
    return dict(rows[-1][1])
