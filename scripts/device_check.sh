#!/usr/bin/env bash
# One round on the GPU machine: install ingot, run the GPU tests and the engine benchmark,
# and write logs and JSON under $OUT (the device tool's output folder).
# Usage: bash scripts/device_check.sh [tests|bench|all]   (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
OUT="${OUT:-out/device}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NOTE: no network there: build with the preinstalled scikit-build-core/nanobind.
python3 -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.csv"
rc=0
if [[ "$WHAT" == tests || "$WHAT" == all ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [[ "$WHAT" == bench || "$WHAT" == all ]]; then
  python3 scripts/bench_engine.py --out "$OUT/bench_engine.json" --work /tmp/ingot-bench \
    > "$OUT/bench_engine.log" 2>&1 || { tail -30 "$OUT/bench_engine.log"; rc=1; }
  tail -45 "$OUT/bench_engine.log"
fi
exit $rc
