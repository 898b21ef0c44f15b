#!/usr/bin/env bash
# Quantized weights on the GPU host in one call (about 8 minutes), Llama-3.1-8B shape with dummy weights:
#   tests:   the W4A16 and block-scaled FP8 Triton kernels and the torch._scaled_mm FP8 products against float64
#            references (bf16 at Llama-3.1-8B's projection shapes, a CUDA graph replay): tests/ops/test_quant_kernels.py;
#   decode:  benchmarks/one_batch.py, batch-1 (and 64) decode steps at a 1024-token context in CUDA graphs, for
#            bf16, FP8 per tensor (--quantization fp8) and per channel (w8a8_fp8: row-wise torch._scaled_mm), FP8 in
#            128x128 blocks (a fine-grained FP8 config: the Triton block GEMM) and W4A16 (a GPTQ config, groups of
#            128: the Triton W4A16 GEMM); random weights are quantized into each layout as they load;
#   offline: offline throughput, 1000 requests of 256 in / 256 out, bf16, FP8 per channel and W4A16, by output tok/s;
#   prefill: (not in the default STEPS) benchmarks/w4a16_prefill.py, W4A16 at 64 to 4096 rows: the tiled kernel against
#            the dequantized weight on cuBLAS (the path from DEQUANTIZE_FROM_ROWS), beside bf16 cuBLAS;
#   tune:    (not in the default STEPS; sized for a call of its own) benchmarks/tune_w4a16.py,
#            the skinny W4A16 and FP8 kernels' tiles at M = 1, 4, 16 on Llama-3.1-8B's projections, in two runs
#            (W4A16, at most 240 s; FP8 per channel, per tensor and in blocks, at most 300 s): a table per run, the
#            estimated batch-1 GEMM time of a step, the rows for the kernels' tables, and $OUT/tune_w4a16.json,
#            $OUT/tune_fp8_skinny.json (written after every case, so a run cut by its limit keeps what it measured).
# STEPS selects (default: tests decode offline), e.g. STEPS="tests decode" bash benchmarks/gpu_quant.sh. Needs .whl/
# (see ../shared/gpu/README.md) and .gpu-assets/llama-3.1-8b-dummy/ (config.json + a tokenizer) carried; the quantized
# variants are made beside it, the same config plus a quantization_config.
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
STEPS=${STEPS:-tests decode offline}

DENSE=$ROOT/.gpu-assets/llama-3.1-8b-dummy
# variant_dir NAME QUANTIZATION_CONFIG_JSON: the dense config plus a quantization_config, with the same tokenizer.
variant_dir() {
    local dir=$ROOT/.gpu-assets/llama-3.1-8b-$1-dummy
    mkdir -p "$dir"
    for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
        [ -f "$DENSE/$f" ] && cp "$DENSE/$f" "$dir/"
    done
    "$PY" -c "import json, sys; c = json.load(open(sys.argv[1])); c['quantization_config'] = json.loads(sys.argv[2]); \
json.dump(c, open(sys.argv[3], 'w'), indent=2)" "$DENSE/config.json" "$2" "$dir/config.json"
    echo "$dir"
}
FP8_BLOCK=$(variant_dir fp8-block '{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}')
W4A16=$(variant_dir w4a16 '{"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}')

if want tests; then
    timeout 300 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q tests/ops/test_quant_kernels.py 2>&1 | tail -8
fi
if want tune; then
    timeout 240 "$PY" benchmarks/tune_w4a16.py --formats w4a16 --out "$OUT/tune_w4a16.json" 2>&1 | grep -v Warning
    timeout 300 "$PY" benchmarks/tune_w4a16.py --formats fp8_channel,fp8_tensor,fp8_block \
        --out "$OUT/tune_fp8_skinny.json" 2>&1 | grep -v Warning
fi
if want prefill; then
    timeout 150 "$PY" benchmarks/w4a16_prefill.py --out "$OUT/w4a16_prefill.json" 2>&1 | grep -v Warning
fi
DECODE=(--load-format dummy --dtype bfloat16 --prefill-batch-sizes 1 --input-len 1024 --decode-batch-sizes 1,64
        --context-len 1024 --eager-batch-sizes 1)
if want decode; then
    for variant in "bf16 $DENSE" "fp8 $DENSE --quantization fp8" "w8a8_fp8 $DENSE --quantization w8a8_fp8" \
                   "fp8_block $FP8_BLOCK" "w4a16 $W4A16"; do
        set -- $variant
        tag=$1 dir=$2
        shift 2
        echo "=== decode $tag"
        timeout 240 "$PY" benchmarks/one_batch.py --model-path "$dir" "${DECODE[@]}" "$@" --out "$OUT" \
            --tag "one_batch_8b_$tag" 2>&1 | grep -v Warning | tail -14
    done
fi
OFFLINE=(--load-format dummy --dtype bfloat16 --dataset random --num-prompts 1000 --random-input-len 256
         --random-output-len 256 --cache on --skip-hf --output-json "$OUT/offline_quant.jsonl"
         --engine-arg mem_fraction_static=0.80)
if want offline; then
    for variant in "bf16 $DENSE" "w8a8_fp8 $DENSE --engine-arg quantization=w8a8_fp8" "w4a16 $W4A16"; do
        set -- $variant
        tag=$1 dir=$2
        shift 2
        echo "=== offline $tag"
        timeout 200 "$PY" benchmarks/offline_throughput.py --model "$dir" "${OFFLINE[@]}" "$@" 2>&1 \
            | grep -v Warning | tail -6
    done
fi
