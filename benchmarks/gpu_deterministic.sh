#!/usr/bin/env bash
# Deterministic inference on the GPU host in one call:
#   tests: the batch-invariant GEMM and the triton backend's row-invariant mode, compiled (tests/ops/test_batch_invariant.py);
#   check + cost: benchmarks/deterministic_cost.py --check on the Llama-3.1-8B shape with random bf16 weights: 16 prompts
#          alone, in a batch of 64, after cache hits and with 32-token chunks, bit for bit; then the cost of the mode
#          against the normal one (FlashInfer, cuBLAS) on 16 x 256 tokens in, 32 out.
# MODEL (default .gpu-assets/llama-3.1-8b-dummy: a config.json and a tokenizer) and STEPS (default "tests check") select.
# Needs .whl/ (see ../shared/gpu/README.md).
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
STEPS=${STEPS:-tests check}
MODEL=${MODEL:-$ROOT/.gpu-assets/llama-3.1-8b-dummy}

if want tests; then
    timeout 240 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -rs tests/ops/test_batch_invariant.py 2>&1 | tail -8
fi
if want check; then
    timeout 420 "$PY" -P benchmarks/deterministic_cost.py --device cuda --dtype bfloat16 --model "$MODEL" \
        --load-format dummy --check --out "$OUT/deterministic_cost_gpu.json" 2>&1 | grep -v Warn | tail -8
fi
