#!/usr/bin/env bash
# Hybrid linear-attention models on the GPU host in one call, Qwen3.5-9B text shape with dummy bf16 weights
# (benchmarks/configs/qwen3.5-9b.json: 32 layers, 24 Gated DeltaNet and 8 gated full attention):
#   tests:      flash-linear-attention's chunked and fused-recurrent gated-delta-rule kernels against the float64
#               reference (tests/ops/test_gated_delta_rule.py, which runs them on the GPU when one is there), and
#               state snapshots through the host tier of the hierarchical cache (tests/cache/test_hybrid_hicache.py)
#               and Qwen3-Next's greedy ids against transformers' (tests/model_runner/test_qwen3_next.py);
#   offline:    offline throughput, 200 requests of 256 in / 256 out, cache on (benchmarks/offline_throughput.py);
#   multi-turn: a server per cache setting (on, off), benchmarks/serving.py --dataset multi-turn, 16 conversations
#               x 6 turns (first prompt 512 tokens, 64 user and 64 output tokens a turn), 8 requests in flight;
#   hicache:    the same workload over a device KV pool of 8,192 tokens (a conversation reaches 1,216 tokens, the 16
#               of them 19,456), the one-tier cache against --enable-hierarchical-cache (snapshots on the host tier);
#   next:       Qwen3-Next's shape cut to its first 12 layers (benchmarks/configs/qwen3-next-80b-a3b.json: 512 experts
#               a layer, so 48 layers of bf16 need more than one card), offline throughput as above with 100 requests:
#               the Gated DeltaNet kernels and the fused MoE kernel in one model.
# STEPS selects (default: all; split them over calls of 10 minutes), e.g. STEPS="tests offline" bash
# benchmarks/gpu_hybrid.sh. Needs .whl/ (see ../shared/gpu/README.md) with fla-core and einops added
# (`bash ../shared/gpu/fetch-wheels.sh fla-core==0.6.0 einops`), and .gpu-assets/llama-3.1-8b-dummy/ (a tokenizer)
# carried; the Qwen3.5 folder is made beside it.
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
STEPS=${STEPS:-tests offline multi-turn hicache next}
PORT=${PORT:-30130}

TOKENIZER=$ROOT/.gpu-assets/llama-3.1-8b-dummy
HYBRID=$ROOT/.gpu-assets/qwen3.5-9b-dummy
mkdir -p "$HYBRID"
cp benchmarks/configs/qwen3.5-9b.json "$HYBRID/config.json"
for f in tokenizer.json tokenizer_config.json; do [ -f "$TOKENIZER/$f" ] && cp "$TOKENIZER/$f" "$HYBRID/"; done

if want tests; then
    timeout 300 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -rs tests/ops/test_gated_delta_rule.py 2>&1 | tail -8
    timeout 300 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -rs tests/cache/test_hybrid_hicache.py \
        tests/model_runner/test_qwen3_next.py -k cuda 2>&1 | tail -8
fi
if want offline; then
    timeout 400 "$PY" benchmarks/offline_throughput.py --model "$HYBRID" --load-format dummy --dtype bfloat16 \
        --dataset random --num-prompts 200 --random-input-len 256 --random-output-len 256 --cache on --skip-hf \
        --output-json "$OUT/offline_hybrid.jsonl" 2>&1 | grep -v Warning | tail -8
fi
serve_multi_turn() {  # label, then the server's flags
    local label=$1
    shift
    setsid "$PY" -m radixserve serve --model-path "$HYBRID" --load-format dummy --dtype bfloat16 --port "$PORT" \
        --log-level warning "$@" >"$OUT/server-hybrid-$label.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
    timeout 300 "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --disable-tqdm \
        --tokenizer "$TOKENIZER" --dataset multi-turn --num-prompts 16 --mt-turns 6 --mt-first-len 512 \
        --mt-user-len 64 --mt-output-len 64 --max-concurrency 8 --label "qwen3.5-9b-$label" \
        --output-file "$OUT/serving-hybrid-$label.json" 2>&1 | tail -14
    kill -TERM "$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    grep -h "state pool\|memory plan\|hierarchical cache" "$OUT/server-hybrid-$label.log" | head -4
}
if want multi-turn; then
    serve_multi_turn cache-on
    serve_multi_turn cache-off --disable-radix-cache
fi
if want hicache; then
    serve_multi_turn pool-8k --max-total-tokens 8192
    serve_multi_turn pool-8k-hicache --max-total-tokens 8192 --enable-hierarchical-cache
fi
if want next; then
    NEXT=$ROOT/.gpu-assets/qwen3-next-12l-dummy
    mkdir -p "$NEXT"
    sed 's/"num_hidden_layers": 48,/"num_hidden_layers": 12,/' benchmarks/configs/qwen3-next-80b-a3b.json \
        >"$NEXT/config.json"
    for f in tokenizer.json tokenizer_config.json; do [ -f "$TOKENIZER/$f" ] && cp "$TOKENIZER/$f" "$NEXT/"; done
    timeout 500 "$PY" benchmarks/offline_throughput.py --model "$NEXT" --load-format dummy --dtype bfloat16 \
        --dataset random --num-prompts 100 --random-input-len 256 --random-output-len 256 --cache on --skip-hf \
        --output-json "$OUT/offline_qwen3_next.jsonl" 2>&1 | grep -v Warning | tail -8
fi
