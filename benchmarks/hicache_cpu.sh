#!/usr/bin/env bash
# The hierarchical cache on the CPU: multi-turn conversations whose working set is 4x the device KV pool, served
# with the host tier off and on (embedded SmolLM2-135M, float32). One server per configuration, started, used and
# stopped by this script; the same client command against each:
#
#   benchmarks/hicache_cpu.sh [OUT_DIR]        (default benchmarks/results/hicache_cpu-<time>)
#
# Workload: 16 conversations x 4 turns (first prompt 128 tokens, 32 new user tokens and 8 output tokens per
# turn), closed loop with 4 requests in flight, so the turns of all conversations interleave; a conversation ends
# at 128 + 3*32 + 4*8 = 256 tokens, 16 of them 4096 tokens = 4x the 1024-token device pool. The host tier is 4x
# the device pool (--hicache-ratio 4), enough for the whole working set.
# Settings (environment): PORT, POOL_TOKENS, HICACHE_RATIO, NUM_CONVERSATIONS.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
PORT=${PORT:-30110}
POOL_TOKENS=${POOL_TOKENS:-1024}
HICACHE_RATIO=${HICACHE_RATIO:-4}
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-16}
OUT=${1:-benchmarks/results/hicache_cpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
if grep -qw amx_tile /proc/cpuinfo; then ISA=amx; elif grep -qw avx512_bf16 /proc/cpuinfo; then ISA=avx512_bf16
elif grep -qw avx512f /proc/cpuinfo; then ISA=avx512f; elif grep -qw avx2 /proc/cpuinfo; then ISA=avx2; else ISA=other; fi
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, ISA $ISA; records and logs: $OUT"

SERVER_PID=
stop_server() {  # SIGTERM to the server, which stops its children; what is left of its group after 60 s
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT

for tier in off on; do
    flags=()
    [ "$tier" = on ] && flags=(--enable-hierarchical-cache --hicache-ratio "$HICACHE_RATIO")
    setsid "$PY" -m radixserve serve --port "$PORT" --log-level warning --max-total-tokens "$POOL_TOKENS" \
        "${flags[@]}" >"$OUT/server-$tier.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited at startup; see $OUT/server-$tier.log"; exit 1; }
        sleep 1
    done
    "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --disable-tqdm --dataset multi-turn \
        --num-prompts "$NUM_CONVERSATIONS" --mt-turns 4 --mt-first-len 128 --mt-user-len 32 --mt-output-len 8 \
        --max-concurrency 4 --label "hicache-$tier" --output-file "$OUT/serving-hicache-$tier.json"
    stop_server
done
"$PY" - "$OUT" "$ISA" <<'PY'
import json, sys
out, isa = sys.argv[1], sys.argv[2]
for tier in ("off", "on"):
    r = json.load(open(f"{out}/serving-hicache-{tier}.json"))
    ttft = r["ttft_ms"]
    print(f"tier {tier}: hit rate {r['cache_hit_rate']:.1%}, TTFT median {ttft['median']:.0f} ms, p99 "
          f"{ttft['p99']:.0f} ms, {r['request_throughput']:.2f} req/s, {r['duration_s']:.1f} s (ISA {isa})")
PY
