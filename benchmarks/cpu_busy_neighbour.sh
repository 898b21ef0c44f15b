#!/usr/bin/env bash
# radixserve's single-stream inter-token latency with the CPU to itself and beside one busy neighbour process
# (`python -c 'while True: pass'`, one core's worth of work): threads that spin while waiting for a core they share
# with the neighbour turn a few milliseconds per token into hundreds. One server per setting in $SETTINGS, each
# measured twice in a row by the same client (benchmarks/serving.py, random 128 in / 64 out, one request at a time):
# quiet, then with the busy loop running.
#
#   benchmarks/cpu_busy_neighbour.sh [OUT_DIR]      (default benchmarks/results/cpu_busy_neighbour-<time>)
#
# Settings (environment): SETTINGS, a space-separated list of `name=ENV,...:FLAGS,...` entries (default: `default`,
# the server as `radixserve serve` starts it; e.g. `spin=OMP_WAIT_POLICY=ACTIVE:` runs with libgomp's threads
# spinning, `f32=:--dtype,float32` with flags); NUM_PROMPTS (4); OUTPUT_LEN (64). Prints mean and p99 ITL per
# setting with the ratio, the CPU's ISA and the load average (other jobs on the machine count too).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
SETTINGS=${SETTINGS:-default}
NUM_PROMPTS=${NUM_PROMPTS:-4}
OUTPUT_LEN=${OUTPUT_LEN:-64}
OUT=${1:-benchmarks/results/cpu_busy_neighbour-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"

SERVER_PID=
BUSY_PID=
stop_all() {
    if [ -n "$BUSY_PID" ]; then kill "$BUSY_PID" 2>/dev/null || true; BUSY_PID=; fi
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_all EXIT

for setting in $SETTINGS; do
    name=${setting%%=*}
    rest=${setting#*=}
    [ "$rest" = "$setting" ] && rest=:
    envs=${rest%%:*}
    flags=${rest#*:}
    port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    echo "== $name (env: ${envs:-none}; flags: ${flags:-none})"
    # shellcheck disable=SC2046,SC2086
    env ${envs//,/ } setsid .venv/bin/radixserve serve $( [ -n "$flags" ] && echo "${flags//,/ }" ) \
        --host 127.0.0.1 --port "$port" --log-level warning >"$OUT/server-$name.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "the server exited at startup; see $OUT/server-$name.log"; exit 1; }
        sleep 1
    done
    for neighbour in quiet busy; do
        if [ "$neighbour" = busy ]; then
            $PY -c "while True: pass" &
            BUSY_PID=$!
        fi
        $PY benchmarks/serving.py --backend openai --base-url "http://127.0.0.1:$port" --dataset random \
            --random-input-len 128 --random-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" --max-concurrency 1 \
            --seed 1 --label "$name $neighbour" --disable-tqdm --output-file "$OUT/serving-$name-$neighbour.json" \
            >"$OUT/serving-$name-$neighbour.txt"
        if [ -n "$BUSY_PID" ]; then kill "$BUSY_PID"; BUSY_PID=; fi
    done
    stop_all
done

$PY - "$OUT" "$SETTINGS" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys

from radixserve.kernels.cpu_build import cpu_isa, cpu_model

out, settings = sys.argv[1], sys.argv[2].split()
print(f"CPU: {cpu_model()}; ISA: {cpu_isa()}, {os.cpu_count()} cores; load average at the end {os.getloadavg()[0]:.1f} "
      "(every process on the machine; the busy loop is one of them while it runs)")
print(f"{'setting':<12} {'ITL mean quiet':>15} {'ITL mean busy':>14} {'ratio':>6} {'ITL p99 quiet':>14} "
      f"{'ITL p99 busy':>13}")
records = []
for setting in settings:
    name = setting.split("=", 1)[0]
    quiet, busy = (json.load(open(f"{out}/serving-{name}-{n}.json")) for n in ("quiet", "busy"))
    ratio = busy["itl_ms"]["mean"] / quiet["itl_ms"]["mean"]
    records.append({"setting": setting, "quiet_itl_ms": quiet["itl_ms"], "busy_itl_ms": busy["itl_ms"],
                    "ratio": ratio})
    print(f"{name:<12} {quiet['itl_ms']['mean']:>15.1f} {busy['itl_ms']['mean']:>14.1f} {ratio:>6.1f} "
          f"{quiet['itl_ms']['p99']:>14.1f} {busy['itl_ms']['p99']:>13.1f}")
json.dump({"benchmark": "cpu busy neighbour", "cpu": cpu_model(), "isa": cpu_isa(), "load_average": os.getloadavg(),
           "records": records}, open(f"{out}/record.json", "w"), indent=1)
EOF
