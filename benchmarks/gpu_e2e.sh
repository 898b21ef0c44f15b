#!/usr/bin/env bash
# End-to-end speed on the GPU host in ONE call (at most ~9 minutes), Llama-3.1-8B shape with dummy bf16 weights:
#   tests:   pytest of the scheduler and the FlashInfer backend on CUDA (outputs equal HF's / a float64 reference);
#   overlap: benchmarks/overlap_idle.py, batch 64 decode-heavy, overlap on vs off, GPU idle fraction;
#   offline: offline throughput, 1000 requests of 256 in / 256 out, overlap on, with the HF `generate` baseline
#            on a subset (padded batches of 64) on the same GPU, compared by output tokens/s;
#   offline-off: the same with the overlap scheduler off;
#   offline-fp8: the same (no HF baseline) with the bf16 KV cache and then with --kv-cache-dtype fp8_e4m3;
#   offline-variants: the same (no HF baseline) once per engine argument in OFFLINE_VARIANTS (default
#            "page_size=16"), e.g. OFFLINE_VARIANTS="page_size=16 chunked_prefill_size=16384";
#   rates:   serving.py random 1024/512 against `radixserve serve` at Poisson rates 4, 8 and 16, 300 requests
#            each, the cache flushed before each rate (the prompts repeat), and the latency-vs-rate plot;
#   gsp:     serving.py generated-shared-prefix (SGLang's defaults, all at once), radix cache on and off.
#   gsp-cascade: the same, radix cache on, cascade attention on (default) and off (--disable-cascade-attn), each
#            followed by the server's /metrics (time to first token, queue time) in $OUT/metrics_*.txt.
#   gsp-clients: the same workload (radix cache and cascade on) from 1 and from 8 client processes.
#   gsp-policy: the same from 8 client processes, against servers with --schedule-policy fcfs (the default), lpm,
#            and lpm with --enable-mixed-chunk; each after a smaller burst (16 x 16 prompts) that compiles the
#            cascade kernels, with the server's Prefill/Decode batch lines in $OUT/gsp_policy_*_scheduler.log;
#            GSP_POLICIES picks the servers (default "fcfs lpm lpm-mixed"; a name given twice runs twice).
# HF_BASELINE=0 leaves the Hugging Face baseline out of the offline step; SERVER_LOG_LEVEL=info keeps the servers'
# start-up lines (the memory plan) in their logs.
# STEPS selects (default: all, in that order; a call is limited to ~10 minutes, so split them), e.g.
#   STEPS="tests overlap" bash benchmarks/gpu_e2e.sh
# Needs .whl/ (see ../shared/gpu/README.md) and .gpu-assets/llama-3.1-8b-dummy/ (config.json + a tokenizer) carried.
set -u
DEADLINE=$((SECONDS + ${SUITE_SECONDS:-540}))
. "$(dirname "$0")/gpu_env.sh"  # the checkout ($ROOT), $OUT, $PY, want; wheels, project, FlashInfer cache
MODEL=$ROOT/.gpu-assets/llama-3.1-8b-dummy
STEPS=${STEPS:-tests overlap offline offline-off rates gsp}
declare -a SUMMARY=()

run_step() {  # NAME CAP COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 cap=$2
    shift 2
    local limit=$((DEADLINE - SECONDS))
    ((limit > cap)) && limit=$cap
    if ((limit < 20)); then SUMMARY+=("$name SKIPPED (no time left)"); return; fi
    echo "=================== $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    tail -n 25 "$OUT/$name.log"
    SUMMARY+=("$(printf '%-14s exit %-4s %4ds' "$name" "$status" $((SECONDS - started)))")
}

if want tests; then
    run_step gpu_pytest 200 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -x tests/scheduler/test_scheduler_gpu.py \
        tests/ops/test_flashinfer_attention.py tests/model_runner/test_cuda_graph.py
fi
if want overlap; then
    run_step overlap_idle 200 "$PY" benchmarks/overlap_idle.py --model "$MODEL" --load-format dummy --dtype bfloat16 \
        --batch-size 64 --input-len 256 --output-len 512 --out "$OUT"
fi
# The offline workload of every offline step: 1000 random prompts of 256 tokens, 256 out, radix cache on.
OFFLINE=("$PY" benchmarks/offline_throughput.py --model "$MODEL" --load-format dummy --dtype bfloat16 --dataset random
         --num-prompts 1000 --random-input-len 256 --random-output-len 256 --cache on)
if want offline; then
    HF=(--hf-device cuda --hf-batch-size 64 --hf-num-prompts 128)
    [[ ${HF_BASELINE:-1} == 0 ]] && HF=(--skip-hf)
    run_step offline_overlap 200 "${OFFLINE[@]}" "${HF[@]}" --output-json "$OUT/offline.jsonl"
fi
if want offline-off; then
    run_step offline_no_overlap 120 "${OFFLINE[@]}" --skip-hf --engine-arg disable_overlap_schedule=true \
        --output-json "$OUT/offline.jsonl"
fi
if want offline-variants; then
    for variant in ${OFFLINE_VARIANTS:-page_size=16}; do
        run_step "offline_${variant//=/_}" 150 "${OFFLINE[@]}" --skip-hf --engine-arg "$variant" \
            --output-json "$OUT/offline_variants.jsonl"
    done
fi
if want offline-fp8; then
    for kv in auto fp8_e4m3; do
        run_step "offline_kv_$kv" 150 "${OFFLINE[@]}" --skip-hf --engine-arg kv_cache_dtype=$kv \
            --output-json "$OUT/offline_kv.jsonl"
    done
fi

serve() {  # start a server with extra flags; wait for /health (the seconds it took go to the summary)
    # From /tmp: `python -m` puts the working directory first on sys.path, where the checkout's thin
    # radixserve/ would shadow the installed package.
    SERVER_LOG="$OUT/server-$RANDOM.log"
    (cd /tmp && exec "$PY" -m radixserve serve \
        --model-path "$MODEL" --load-format dummy --dtype bfloat16 --port 30000 --log-level "${SERVER_LOG_LEVEL:-warning}" "$@" \
        > "$SERVER_LOG" 2>&1) &
    SERVER=$!
    local started=$SECONDS
    for _ in $(seq 1 360); do  # up to 3 minutes: a fresh host JIT-compiles the FlashInfer kernels
        if curl -sf http://127.0.0.1:30000/health > /dev/null; then
            SUMMARY+=("server $* ready after $((SECONDS - started))s")
            return 0
        fi
        sleep 0.5
    done
    return 1
}
stop_server() { kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; }
BENCH=("$PY" benchmarks/serving.py --backend radixserve --base-url http://127.0.0.1:30000 --tokenizer "$MODEL" --disable-tqdm)

if want rates || want gsp; then
    if serve; then
        if want rates; then
            for rate in 4 8 16; do
                run_step "random_rate_$rate" $((300 / rate + 45)) "${BENCH[@]}" --dataset random --num-prompts 300 \
                    --random-input-len 1024 --random-output-len 512 --request-rate $rate --flush-cache \
                    --label radixserve --output-file "$OUT/random_rate_$rate.json"
            done
            "$PY" benchmarks/serving.py plot "$OUT"/random_rate_*.json -o "$OUT/latency_vs_rate.png" > /dev/null 2>&1
        fi
        want gsp && run_step gsp_cache_on 90 "${BENCH[@]}" --dataset generated-shared-prefix --request-rate inf \
            --flush-cache --label cache-on --output-file "$OUT/gsp_on.json"
    else
        SUMMARY+=("server (cache on) did not start")
    fi
    stop_server
fi
if want gsp-cascade; then
    for cascade in on off; do
        flags=()
        [[ $cascade == off ]] && flags=(--disable-cascade-attn)
        if serve "${flags[@]}"; then
            run_step "gsp_cascade_$cascade" 100 "${BENCH[@]}" --dataset generated-shared-prefix --request-rate inf \
                --flush-cache --label "cascade-$cascade" --output-file "$OUT/gsp_cascade_$cascade.json"
            curl -s http://127.0.0.1:30000/metrics | grep -E "^radixserve:(time_to_first_token|e2e_request|tenant_queue_time|inter_token)[a-z_]*_(sum|count)" \
                > "$OUT/metrics_cascade_$cascade.txt"
            curl -s http://127.0.0.1:30000/get_server_info | grep -o '"cascade_batches": *[0-9]*' \
                >> "$OUT/metrics_cascade_$cascade.txt"
            cat "$OUT/metrics_cascade_$cascade.txt"
        else
            SUMMARY+=("server (cascade $cascade) did not start")
        fi
        stop_server
    done
fi
if want gsp-clients; then
    if serve; then
        for procs in 1 8; do
            run_step "gsp_clients_$procs" 100 "${BENCH[@]}" --dataset generated-shared-prefix --request-rate inf \
                --flush-cache --client-processes $procs --label "clients-$procs" --output-file "$OUT/gsp_clients_$procs.json"
        done
    else
        SUMMARY+=("server (gsp-clients) did not start")
    fi
    stop_server
fi
if want gsp-policy; then
    run=0
    for config in ${GSP_POLICIES:-fcfs lpm lpm-mixed}; do
        run=$((run + 1))
        flags=(--schedule-policy "${config%-mixed}")
        [[ $config == *-mixed ]] && flags+=(--enable-mixed-chunk)
        name=$config
        [[ -e $OUT/gsp_policy_$name.json ]] && name=${config}_$run  # a name given again
        if serve "${flags[@]}" --log-level info; then
            run_step "gsp_policy_${name}_warmup" 60 "${BENCH[@]}" --dataset generated-shared-prefix --request-rate inf \
                --gsp-num-groups 16 --gsp-prompts-per-group 16 --gsp-output-len 24 --output-file "$OUT/gsp_policy_warmup.json"
            run_step "gsp_policy_$name" 100 "${BENCH[@]}" --dataset generated-shared-prefix --request-rate inf \
                --flush-cache --client-processes 8 --label "$config" --output-file "$OUT/gsp_policy_$name.json"
            grep -hE "Prefill batch|Decode batch" "$SERVER_LOG" > "$OUT/gsp_policy_${name}_scheduler.log"
        else
            SUMMARY+=("server ($name) did not start")
        fi
        stop_server
    done
fi
if want gsp; then
    if serve --disable-radix-cache; then
        run_step gsp_cache_off 150 "${BENCH[@]}" --dataset generated-shared-prefix --request-rate inf \
            --label cache-off --output-file "$OUT/gsp_off.json"
    else
        SUMMARY+=("server (cache off) did not start")
    fi
    stop_server
fi

echo "=================== summary"
grep -h -A12 "^workload" "$OUT"/offline_*.log 2>/dev/null
for line in "${SUMMARY[@]}"; do echo "$line"; done
echo "total ${SECONDS}s"
