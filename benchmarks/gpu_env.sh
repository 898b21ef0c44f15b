# Sourced first by the GPU scripts of benchmarks/: goes to the checkout ($ROOT), makes $OUT (default
# benchmarks/results), picks $PY ($PYTHON or python3) and defines `want STEP` (is STEP in the script's $STEPS); then
# installs the carried wheels (.whl/, ../shared/gpu/README.md) and the project into /tmp/site, points Python at them and
# FlashInfer's JIT cache at the checkout's .gpu-cache (kept while the GPU host stays warm), and records the card in
# $OUT/gpu.txt.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
want() { [[ " ${STEPS:-} " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
# Installed (not mapped from the source tree), so that the Engine's spawned processes import it too.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . \
    || echo "WARNING: installing radixserve failed"
export PYTHONPATH=/tmp/site:$ROOT/benchmarks
export FLASHINFER_WORKSPACE_BASE=$ROOT/.gpu-cache
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
