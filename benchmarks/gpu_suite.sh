#!/usr/bin/env bash
# The GPU checks and benchmarks of the GPU path in ONE call on the GPU host (at most ~9 minutes):
#   1. pytest of the GPU tests: FlashInfer and Triton attention, decode CUDA graphs (compiles FlashInfer's
#      kernels into .gpu-cache/ for the later steps);
#   2. benchmarks/one_batch.py on the Llama-3.1-8B shape with dummy bf16 weights: prefill of 1024 tokens at
#      batch 1, 8, 32; decode at batch 1..256 with 1024 tokens of context against the floor; batch-1 decode
#      without CUDA graphs too; a kernel profile of batch-1 decode;
#   3. benchmarks/fused_kernels_bench.py: the fused Triton kernels against the torch path, per op;
#   4. benchmarks/gpu_check.py: every attention backend against a float64 reference, per-layer timings.
#
# Usage, from the checkout (the `run` tool carries .whl/, filled by ../shared/gpu/fetch-wheels.sh plus pytest's
# wheels):   bash benchmarks/gpu_suite.sh
# Writes every log and JSON to $OUT (default benchmarks/results/). A failing or timed-out step is reported
# and the next one runs; the summary comes last. Exit status 1 if any step failed.
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${SUITE_SECONDS:-530}))
PY=${PYTHON:-python3}

declare -a SUMMARY=()
FAILED=0

# run_step NAME CAP_SECONDS RESERVE_SECONDS COMMAND...: run with a time limit of CAP, shortened so that
# RESERVE seconds stay for the steps after it; output to $OUT/NAME.log and the console.
run_step() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    local limit=$((DEADLINE - SECONDS - reserve))
    ((limit > cap)) && limit=$cap
    if ((limit < 20)); then
        SUMMARY+=("$(printf '%-10s SKIPPED (no time left)' "$name")")
        FAILED=1
        return
    fi
    echo
    echo "=================== $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    local took=$((SECONDS - started))
    local verdict="ok"
    if ((status == 124 || status == 137)); then
        verdict="TIMEOUT after ${limit}s"
        FAILED=1
    elif ((status != 0)); then
        verdict="FAILED (exit $status)"
        FAILED=1
    fi
    SUMMARY+=("$(printf '%-10s %-24s %4ds' "$name" "$verdict" "$took")")
}

echo "=================== setup"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
        || echo "WARNING: installing the carried wheels failed"
else
    echo "WARNING: no .whl/ wheels carried (bash ../shared/gpu/fetch-wheels.sh pytest pluggy iniconfig packaging pygments)"
fi
export PYTHONPATH=/tmp/site:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=$ROOT/.gpu-cache
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT/gpu.txt"
import importlib, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "flashinfer", "transformers", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "NOT IMPORTABLE:", type(exc).__name__, exc)
EOF

# -p _srcpath maps radixserve.<folder> onto the checkout before conftest imports it (not pip-installed here).
run_step pytest 250 230 "$PY" -P -m pytest -p _srcpath -p no:cacheprovider -q -rs \
    --junitxml "$OUT/pytest.xml" \
    tests/ops/test_flashinfer_attention.py tests/ops/test_triton_attention.py tests/model_runner/test_cuda_graph.py \
    tests/ops/test_fused_kernels.py tests/model_runner/test_sampling.py

run_step one_batch 200 60 "$PY" benchmarks/one_batch.py \
    --config benchmarks/configs/llama-3.1-8b.json --load-format dummy --dtype bfloat16 \
    --prefill-batch-sizes 1,8,32 --input-len 1024 \
    --decode-batch-sizes 1,8,32,64,128,256 --context-len 1024 \
    --eager-batch-sizes 1 --profile-batch-size 1 \
    --out "$OUT" --tag one_batch_llama3.1_8b_bf16

run_step fused 90 60 "$PY" benchmarks/fused_kernels_bench.py \
    --config benchmarks/configs/llama-3.1-8b.json --batch-sizes 1,8,64

run_step gpu_check 240 0 "$PY" benchmarks/gpu_check.py --out "$OUT"

echo
echo "=================== summary (logs and JSON in $OUT)"
grep -E "passed|failed|error" "$OUT/pytest.log" 2>/dev/null | tail -n 3
grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" 2>/dev/null | head -n 20
if [[ -f "$OUT/one_batch.log" ]]; then
    sed -n '/^== /,$p' "$OUT/one_batch.log"
fi
grep -E "checks passed" "$OUT/gpu_check.log" 2>/dev/null
for line in "${SUMMARY[@]}"; do echo "$line"; done
echo "total ${SECONDS}s"
exit $FAILED
