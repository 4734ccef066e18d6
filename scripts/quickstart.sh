#!/usr/bin/env bash
# Installs ingot, makes a tiny Llama-family model offline, and runs convert -> build -> run.
# Usage: bash scripts/quickstart.sh [WORK_DIR]   (default: ./out/quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:-out/quickstart}"
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
mkdir -p "$WORK"
python3 -m ingot.compiler.examples --family llama --out "$WORK/hf-tiny-llama"
ingot convert-checkpoint --model-dir "$WORK/hf-tiny-llama" --output-dir "$WORK/ckpt" --dtype float32 --force
ingot build-engine --checkpoint-dir "$WORK/ckpt" --output-dir "$WORK/engine" --config tiny-llama --target cpu --force
ingot inspect-engine "$WORK/engine"
ingot run-engine --engine-dir "$WORK/engine" --max-output-len 24 \
  --input-text "The compiler turns a model into" \
  --input-text "Once upon a time" \
  --input-text "A GPU reads memory"
