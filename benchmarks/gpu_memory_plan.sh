#!/usr/bin/env bash
# The memory plan on the GPU host in one call: the 8B plan (benchmarks/memory_plan.py), the GPU tests of the plan
# and the CUDA graphs, then gpu_e2e.sh offline (without the Hugging Face baseline) and gsp with default settings.
# Needs .whl/ and .gpu-assets/ carried. TESTS=0 leaves the pytest step out; PLAN=0 the plan step.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/site/radixserve /tmp/site/radixserve-*  # a copy gpu_e2e.sh installed on this machine before: use the checkout's
export PYTHONPATH=/tmp/site:$PWD/benchmarks
export FLASHINFER_WORKSPACE_BASE=$PWD/.gpu-cache; mkdir -p $FLASHINFER_WORKSPACE_BASE
nvidia-smi --query-gpu=name,memory.total --format=csv
M=.gpu-assets/llama-3.1-8b-dummy
if [[ ${PLAN:-1} == 1 ]]; then
    timeout 180 python3 benchmarks/memory_plan.py --model $M --load-format dummy --dtype bfloat16 \
        --out $OUT/plan_default.json 2>&1 | grep -v Warning | tail -15
fi
if [[ ${TESTS:-1} == 1 ]]; then
    timeout -k 10 200 python3 -P -m pytest -p _srcpath -p no:cacheprovider -q --tb=short -m gpu \
        tests/model_runner/test_memory_plan.py tests/model_runner/test_cuda_graph.py > $OUT/pytest.log 2>&1
    grep -v Warning $OUT/pytest.log | grep -E "^E |Error|passed|failed" | tail -20
fi
OUT=$OUT/e2e STEPS="offline gsp" HF_BASELINE=0 SERVER_LOG_LEVEL=info SUITE_SECONDS=${E2E_SECONDS:-300} \
    bash benchmarks/gpu_e2e.sh 2>&1 | grep -v Warning | tail -40
grep -h "memory plan\|out of memory\|OutOfMemory\|failed" $OUT/e2e/*.log | head
