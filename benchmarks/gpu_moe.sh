#!/usr/bin/env bash
# Mixture-of-experts on the GPU host in one call (about 9 minutes), Qwen3-30B-A3B shape with dummy bf16 weights:
#   tests:   the fused MoE Triton kernels, aligned and decode paths, against the float64 reference (bf16 at the
#            Qwen3-30B-A3B layer shape, CUDA graph replays) and the routing kernel against the torch form,
#            tests/ops/test_fused_moe_kernel.py and tests/ops/test_moe_routing_kernel.py;
#   decode:  benchmarks/one_batch.py, batch-1 (and 8, 64) decode steps at a 1024-token context in CUDA graphs, next to
#            the floor: bytes of attention, router and the experts the batch visits (8 of 128 per layer at batch 1),
#            plus KV, over the device-to-device bandwidth it measures; then the top kernels of a batch-1 graph step.
#            Batches 1 and 8 take the fused MoE's decode path and every batch the routing kernel;
#   decode_aligned (not in the default STEPS): batches 1 and 8 again with both turned off (the module constants
#            fused_moe_triton.DECODE_MAX_PAIRS and moe_routing.MAX_EXPERTS set to 0), i.e. the aligned path and the
#            torch routing: STEPS="tests decode decode_aligned" gives the side-by-side in one call;
#   offline: offline throughput, 1000 requests of 256 in / 256 out, Qwen3-30B-A3B and then Llama-3.1-8B (the dense
#            baseline of about 2.4x the active parameters) in the same call, by output tokens/s;
#   quantized experts (none in the default STEPS): the same config with a quantization_config, the experts held
#            quantized by the fused kernels' variants and the attention on the quantized GEMMs:
#            quant_tests  tests/ops/test_fused_moe_quantized.py (FP8 and 4-bit experts against float64, bf16 at the
#                         Qwen3-30B-A3B layer shape);
#            fp8, fp8_offline      Qwen3-30B-A3B-FP8's layout (fine-grained FP8, 128x128 blocks, about 30 GB of
#                         weights): batch-1/8/64 decode steps, then the offline figure above;
#            w4a16, w4a16_offline  a GPTQ layout (4 bits, groups of 128, about 16 GB): the same two.
# STEPS selects (default: all), e.g. STEPS="tests decode" bash benchmarks/gpu_moe.sh. Needs .whl/ (see
# ../shared/gpu/README.md) and .gpu-assets/llama-3.1-8b-dummy/ (config.json + a tokenizer) carried; the Qwen3-30B-A3B
# folder is made beside it from benchmarks/configs/qwen3-30b-a3b.json and the same tokenizer files (random weights emit
# ids past that tokenizer's vocabulary, which decode to nothing: the figures count tokens, not text).
# The weights take about 61 GB: an H100 80GB leaves little room for the KV pool, an H200 plenty.
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
STEPS=${STEPS:-tests decode offline}

DENSE=$ROOT/.gpu-assets/llama-3.1-8b-dummy
MOE=$ROOT/.gpu-assets/qwen3-30b-a3b-dummy
mkdir -p "$MOE"
cp benchmarks/configs/qwen3-30b-a3b.json "$MOE/config.json"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    [ -f "$DENSE/$f" ] && cp "$DENSE/$f" "$MOE/"
done
# quantized_dir NAME QUANTIZATION_CONFIG_JSON: the MoE folder plus a quantization_config, with the same tokenizer.
quantized_dir() {
    local dir=$ROOT/.gpu-assets/qwen3-30b-a3b-$1-dummy
    mkdir -p "$dir"
    cp "$MOE"/tokenizer* "$MOE"/chat_template.jinja "$dir/" 2>/dev/null
    "$PY" -c "import json, sys; c = json.load(open(sys.argv[1])); c['quantization_config'] = json.loads(sys.argv[2]); \
json.dump(c, open(sys.argv[3], 'w'), indent=2)" "$MOE/config.json" "$2" "$dir/config.json"
    echo "$dir"
}
MOE_FP8=$(quantized_dir fp8 '{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}')
MOE_W4A16=$(quantized_dir w4a16 '{"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}')

if want tests; then
    timeout 240 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q tests/ops/test_fused_moe_kernel.py \
        tests/ops/test_moe_routing_kernel.py 2>&1 | tail -8
fi
if want decode; then
    timeout 300 "$PY" benchmarks/one_batch.py --model-path "$MOE" --load-format dummy --dtype bfloat16 \
        --prefill-batch-sizes 1 --input-len 1024 --decode-batch-sizes 1,8,64 --context-len 1024 \
        --eager-batch-sizes 1 --profile-batch-size 1 --out "$OUT" --tag one_batch_qwen3_30b_a3b 2>&1 \
        | grep -v Warning | tail -50
fi
if want decode_aligned; then
    timeout 240 "$PY" - --model-path "$MOE" --load-format dummy --dtype bfloat16 --prefill-batch-sizes "" \
        --decode-batch-sizes 1,8 --context-len 1024 --eager-batch-sizes "" --profile-batch-size 1 --out "$OUT" \
        --tag one_batch_qwen3_30b_a3b_aligned <<'EOF' 2>&1 | grep -v Warning | tail -40
import runpy
import sys

import radixserve.kernels.fused_moe_triton as fused_moe_triton
import radixserve.kernels.moe_routing as moe_routing

fused_moe_triton.DECODE_MAX_PAIRS = 0  # every call takes the aligned path
moe_routing.MAX_EXPERTS = 0  # select_experts keeps the torch form
sys.argv[0] = "benchmarks/one_batch.py"
sys.path.insert(0, "benchmarks")  # as running the script would
runpy.run_path("benchmarks/one_batch.py", run_name="__main__")
EOF
fi
OFFLINE=(--load-format dummy --dtype bfloat16 --dataset random --num-prompts 1000 --random-input-len 256
         --random-output-len 256 --cache on --skip-hf --output-json "$OUT/offline_moe.jsonl")
if want offline; then
    timeout 300 "$PY" benchmarks/offline_throughput.py --model "$MOE" "${OFFLINE[@]}" 2>&1 | grep -v Warning | tail -8
    timeout 200 "$PY" benchmarks/offline_throughput.py --model "$DENSE" "${OFFLINE[@]}" 2>&1 | grep -v Warning | tail -8
fi
if want quant_tests; then
    timeout 200 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q tests/ops/test_fused_moe_quantized.py 2>&1 | tail -4
fi
for variant in "fp8 $MOE_FP8" "w4a16 $MOE_W4A16"; do
    set -- $variant
    if want "$1"; then
        timeout 240 "$PY" benchmarks/one_batch.py --model-path "$2" --load-format dummy --dtype bfloat16 \
            --prefill-batch-sizes "" --decode-batch-sizes 1,8,64 --context-len 1024 --eager-batch-sizes "" \
            --profile-batch-size 1 --out "$OUT" --tag "one_batch_qwen3_30b_a3b_$1" 2>&1 | grep -v Warning | tail -36
    fi
    if want "$1_offline"; then
        timeout 200 "$PY" benchmarks/offline_throughput.py --model "$2" "${OFFLINE[@]}" 2>&1 | grep -v Warning | tail -8
    fi
done
