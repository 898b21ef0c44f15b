#!/usr/bin/env bash
# Hybrid sliding-window memory on the GPU host in one call:
#   tests:  the FlashInfer and compiled Triton backends reading and writing a window layer's KV through its own slot
#           space (tests/ops/test_flashinfer_attention.py, tests/ops/test_triton_attention.py), and Triton's decode
#           CUDA graphs with window slots against eager decode (tests/model_runner/test_cuda_graph.py), `-k window_slots`;
#   memory: benchmarks/swa_memory.py with the Gemma 3 4B text shape and random bf16 weights
#           (benchmarks/configs/gemma-3-4b.json, window 1,024): 32 requests of 4,096 + 64 tokens in the memory of
#           40,000 full-layout tokens, the full layout against window slots at ratios 0.8 and 0.25, triton and
#           flashinfer attention.
# STEPS selects (default: all), e.g. STEPS=tests bash benchmarks/gpu_swa.sh. Needs .whl/ (see ../shared/gpu/README.md).
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
STEPS=${STEPS:-tests memory}

if want tests; then
    timeout 400 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -rs -k window_slots \
        tests/ops/test_flashinfer_attention.py tests/ops/test_triton_attention.py tests/model_runner/test_cuda_graph.py \
        2>&1 | tail -8
fi
if want memory; then
    for backend in triton flashinfer; do
        timeout 500 "$PY" benchmarks/swa_memory.py --device cuda --dtype bfloat16 --attention-backend "$backend" \
            --config benchmarks/configs/gemma-3-4b.json --num-requests 32 --prompt-len 4096 --max-new-tokens 64 \
            --max-total-tokens 40000 --chunked-prefill-size 4096 --ratios 0.8,0.25 \
            --out "$OUT/swa_memory_gpu_$backend.json" 2>&1 | tail -6
    done
fi
