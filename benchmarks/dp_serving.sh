#!/usr/bin/env bash
# Data parallelism on one host: the generated-shared-prefix workload served by one replica, by --dp-size 2 with
# cache-aware routing and by --dp-size 2 with round robin (embedded SmolLM2-135M, float32 on the CPU, where the
# replicas split the cores; on a GPU host each replica takes its own GPU). One server per configuration, started,
# used and stopped by this script; the same client command against each:
#
#   benchmarks/dp_serving.sh [OUT_DIR]        (default benchmarks/results/dp_serving-<time>)
#
# Workload: 8 groups x 8 prompts (system prompt 256 tokens, question 32, output 16), all at once.
# Settings (environment): PORT, NUM_GROUPS, PER_GROUP, SYSTEM_LEN, EXTRA_FLAGS (e.g. "--model-path M --dtype bfloat16").
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
PORT=${PORT:-30120}
NUM_GROUPS=${NUM_GROUPS:-8}
PER_GROUP=${PER_GROUP:-8}
SYSTEM_LEN=${SYSTEM_LEN:-256}
OUT=${1:-benchmarks/results/dp_serving-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
if grep -qw amx_tile /proc/cpuinfo; then ISA=amx; elif grep -qw avx512_bf16 /proc/cpuinfo; then ISA=avx512_bf16
elif grep -qw avx512f /proc/cpuinfo; then ISA=avx512f; elif grep -qw avx2 /proc/cpuinfo; then ISA=avx2; else ISA=other; fi
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, ISA $ISA; records and logs: $OUT"

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

for config in dp1 dp2-cache_aware dp2-round_robin; do
    case $config in
        dp1) flags=(--dp-size 1) ;;
        dp2-cache_aware) flags=(--dp-size 2 --load-balance-method cache_aware) ;;
        dp2-round_robin) flags=(--dp-size 2 --load-balance-method round_robin) ;;
    esac
    # shellcheck disable=SC2086
    setsid "$PY" -m radixserve serve --port "$PORT" --log-level warning "${flags[@]}" ${EXTRA_FLAGS:-} \
        >"$OUT/server-$config.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited at startup; see $OUT/server-$config.log"; exit 1; }
        sleep 1
    done
    "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --disable-tqdm \
        --dataset generated-shared-prefix --gsp-num-groups "$NUM_GROUPS" --gsp-prompts-per-group "$PER_GROUP" \
        --gsp-system-prompt-len "$SYSTEM_LEN" --gsp-question-len 32 --gsp-output-len 16 \
        --label "$config" --output-file "$OUT/serving-$config.json"
    stop_server
done
"$PY" - "$OUT" "$ISA" <<'PY'
import json, sys
out, isa = sys.argv[1], sys.argv[2]
print(f"| configuration | hit rate | output tok/s | TTFT median ms | TTFT p99 ms | ITL median ms | (ISA {isa}) |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
for config in ("dp1", "dp2-cache_aware", "dp2-round_robin"):
    r = json.load(open(f"{out}/serving-{config}.json"))
    print(f"| {config} | {r['cache_hit_rate']:.1%} | {r['output_throughput']:.1f} | {r['ttft_ms']['median']:.0f} | "
          f"{r['ttft_ms']['p99']:.0f} | {r['itl_ms']['median']:.0f} | |")
PY
