#!/usr/bin/env bash
# The memory plan on the GPU host in one call: the 8B plan (benchmarks/memory_plan.py), the GPU tests of the plan
# and the CUDA graphs, then gpu_e2e.sh offline and gsp with default settings. Needs .whl/ and .gpu-assets/ carried.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/site/radixserve /tmp/site/radixserve-*  # a copy gpu_e2e.sh installed on this machine before: use the checkout's
export PYTHONPATH=/tmp/site:$PWD/benchmarks
export FLASHINFER_WORKSPACE_BASE=$PWD/.gpu-cache; mkdir -p $FLASHINFER_WORKSPACE_BASE
nvidia-smi --query-gpu=name,memory.total --format=csv
M=.gpu-assets/llama-3.1-8b-dummy
timeout 180 python3 benchmarks/memory_plan.py --model $M --load-format dummy --dtype bfloat16 --out $OUT/plan_default.json 2>&1 | grep -v Warning | tail -15
timeout 100 python3 -P -m pytest -p _srcpath -p no:cacheprovider -q -x tests/test_memory_plan.py tests/test_cuda_graph.py 2>&1 | tail -5
OUT=$OUT/e2e STEPS="offline gsp" SUITE_SECONDS=${E2E_SECONDS:-300} bash benchmarks/gpu_e2e.sh 2>&1 | tail -40
grep -h "memory plan\|out of memory\|OutOfMemory" $OUT/e2e/*.log | head
