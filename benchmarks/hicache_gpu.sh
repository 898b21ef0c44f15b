#!/usr/bin/env bash
# The hierarchical cache on the GPU host: multi-turn conversations whose working set is 4x the device KV pool,
# served with the host tier off and on (Llama-3.1-8B shape, dummy bf16 weights, FlashInfer, CUDA graphs), after
# the CUDA correctness test of the tier (tests/cache/test_hicache_gpu.py). One server per configuration:
#
#   OUT=... bash benchmarks/hicache_gpu.sh
#
# Workload: 64 conversations x 4 turns (first prompt 1024 tokens, 256 new user tokens and 64 output tokens per
# turn), closed loop with 16 requests in flight, so the turns of all conversations interleave; a conversation ends
# at 1024 + 3*256 + 4*64 = 2048 tokens, 64 of them 131,072 tokens = 4x the 32,768-token device pool. The host tier
# is 4x the device pool (--hicache-ratio 4): the whole working set.
# Needs .whl/ and .gpu-assets/llama-3.1-8b-dummy/ carried (see gpu_e2e.sh). Settings: POOL_TOKENS, NUM_CONVERSATIONS,
# MT_FIRST, MT_USER, MT_OUTPUT (the turn shape), TIERS ("off on"), SKIP_TESTS.
set -u
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
MODEL=$ROOT/.gpu-assets/llama-3.1-8b-dummy
PORT=${PORT:-30130}
POOL_TOKENS=${POOL_TOKENS:-32768}
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-64}
MT_FIRST=${MT_FIRST:-1024}
MT_USER=${MT_USER:-256}
MT_OUTPUT=${MT_OUTPUT:-64}

if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -x tests/cache/test_hicache_gpu.py 2>&1 \
        | tee "$OUT/hicache_gpu_pytest.log" | tail -5
fi

SERVER_PID=
stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT

for tier in ${TIERS:-off on}; do
    flags=()
    [ "$tier" = on ] && flags=(--enable-hierarchical-cache --hicache-ratio 4)
    # From /tmp: the checkout's radixserve/ would shadow the installed package.
    (cd /tmp && exec setsid "$PY" -m radixserve serve --port "$PORT" --log-level warning --model-path "$MODEL" --load-format dummy \
        --dtype bfloat16 --max-total-tokens "$POOL_TOKENS" "${flags[@]}") >"$OUT/server-hicache-$tier.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 400); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited at startup"; tail -30 "$OUT/server-hicache-$tier.log"; exit 1; }
        sleep 1
    done
    "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --disable-tqdm \
        --dataset multi-turn --num-prompts "$NUM_CONVERSATIONS" --mt-turns 4 --mt-first-len "$MT_FIRST" \
        --mt-user-len "$MT_USER" --mt-output-len "$MT_OUTPUT" --max-concurrency 16 --label "hicache-$tier" \
        --output-file "$OUT/serving-hicache-gpu-$tier.json" 2>&1 | tail -25
    stop_server
done
"$PY" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
for tier in ("off", "on"):
    path = f"{out}/serving-hicache-gpu-{tier}.json"
    if not os.path.exists(path):
        continue
    r = json.load(open(path))
    ttft = r["ttft_ms"]
    print(f"tier {tier}: hit rate {r['cache_hit_rate']:.1%}, TTFT median {ttft['median']:.1f} ms, p99 "
          f"{ttft['p99']:.1f} ms, {r['output_throughput']:.0f} output tok/s, {r['duration_s']:.1f} s")
PY
