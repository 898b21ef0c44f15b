#!/usr/bin/env bash
# gpt-oss on the GPU host in one call (about 8 minutes), gpt-oss-20b's shape with dummy bf16 weights:
#   tests:   attention sinks in FlashInfer (plain, windowed and cascade decode) and compiled Triton against a float64
#            reference at gpt-oss's head_dim of 64 and GQA of 8 (tests/ops/test_attention_sinks.py),
#            and the fused MoE Triton kernels with gpt-oss's biases and clamped SwiGLU
#            (tests/ops/test_fused_moe_kernel.py);
#            then the tiny gpt-oss model on the GPU: Triton in float32 against the CPU path's greedy ids, FlashInfer in
#            bfloat16 against torch_native's (tests/model_runner/test_gpt_oss.py -k gpu);
#   decode:  benchmarks/one_batch.py on benchmarks/configs/gpt-oss-20b.json (24 layers, 32 experts top-4, windows of
#            128 on every other layer), prefill of 1 and 8 x 1024 tokens and decode at batch 1, 8 and 64 at a 1024-token
#            context, with FlashInfer and then with Triton attention;
#   mxfp4:   decode at batch 1, 8 and 64 at a 1024-token context with the experts held as MXFP4 (the default) and as
#            FP8 on gpt-oss-20b's shape, and as MXFP4 on gpt-oss-120b's (benchmarks/configs/gpt-oss-120b.json: 36
#            layers, 128 experts; about 65 GB of weights, which fit an H100 80GB as MXFP4 only).
# STEPS selects (default: tests and decode), e.g. STEPS="tests" bash benchmarks/gpu_gpt_oss.sh. Needs .whl/ (see
# ../shared/gpu/README.md) carried. The dummy weights take about 42 GB: an H100 80GB holds them with a KV pool.
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
STEPS=${STEPS:-tests decode}

if want tests; then
    timeout 300 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q tests/ops/test_attention_sinks.py \
        tests/ops/test_fused_moe_kernel.py 2>&1 | tail -12
    timeout 240 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q tests/model_runner/test_gpt_oss.py -k gpu \
        2>&1 | tail -8
fi
if want decode; then
    for backend in flashinfer triton; do
        timeout 240 "$PY" benchmarks/one_batch.py --config benchmarks/configs/gpt-oss-20b.json --dtype bfloat16 \
            --attention-backend "$backend" --prefill-batch-sizes 1,8 --input-len 1024 --decode-batch-sizes 1,8,64 \
            --context-len 1024 --out "$OUT" --tag "one_batch_gpt_oss_20b_$backend" 2>&1 | grep -v Warning | tail -20
    done
fi
if want mxfp4; then
    for variant in "gpt-oss-20b mxfp4" "gpt-oss-20b fp8" "gpt-oss-120b mxfp4"; do
        set -- $variant
        timeout 240 "$PY" benchmarks/one_batch.py --config "benchmarks/configs/$1.json" --dtype bfloat16 \
            --mxfp4-experts "$2" --prefill-batch-sizes "" --decode-batch-sizes 1,8,64 --context-len 1024 \
            --eager-batch-sizes "" --out "$OUT" --tag "one_batch_${1//-/_}_$2" 2>&1 | grep -v Warning | tail -8
    done
fi
