#!/bin/bash
# The real-GPU proof, as run through the device tool (see benchmarks/results/README.md):
#   bash benchmarks/gpu/run_gpu_suite.sh tests|overhead|all
# Needs the wheels of trio, outcome, sniffio and pyzmq in .whl/ when the machine lacks them.
# Writes everything under $OUT (or ./gpu-out).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export NVSHARE_GPU_RESULTS=$OUT/gpu-tests.jsonl
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' | tee -a "$OUT/gpu.txt"
what=${1:-all}
if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest tests/gpu tests/test_driver.py tests/test_simcuda.py tests/test_deviceplugin.py -m gpu \
        -p no:cacheprovider -q -rA --timeout 500 2>&1 | tee "$OUT/pytest-gpu.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed"
fi
if [ "$what" = overhead ] || [ "$what" = all ]; then
    python3 benchmarks/bench_overhead.py --out "$OUT/overhead.json" 2>&1 | tail -3
fi
