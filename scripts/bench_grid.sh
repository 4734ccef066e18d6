#!/usr/bin/env bash
# The standard H200 grid: one folder with grid-standard.{json,md,png}.
#
#   bash scripts/bench_grid.sh OUT_DIR [ENGINE_DIR]
#
# Without ENGINE_DIR it first makes a Llama-3.1-8B-shaped model with random bf16 weights
# (scripts/bench_engine.py's make_model; nothing downloaded) and builds it with the
# llama-3.1-8b-bf16 preset into OUT_DIR/work/engine (kept: a second run reuses it). The grid
# (`ingot bench --grid standard --baseline hf`): latency at batch 1 (128/128, 5 requests);
# throughput at 128/128 (256 requests), 128/2048 (64), 2048/128 (128), 2048/2048 (64), the
# HF baseline on the first 32 of each (ratios compare rates); serve 128/128 at 4, 16 and
# 64 requests/s (128 requests, HF 16). Extra flags after ENGINE_DIR go to `ingot bench`
# (e.g. --num-requests / --hf-num-requests to shrink every point). PDL=1 builds the engine
# with programmatic dependent launch (build-engine --pdl).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/bench_grid.sh OUT_DIR [ENGINE_DIR] [ingot bench flags...]}
engine=${2:-}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
if [[ -z "$engine" ]]; then
  engine="$out/work/engine"
  if [[ ! -f "$engine/config.json" ]]; then
    echo "making a Llama-3.1-8B-shaped bf16 engine in $engine" >&2
    start=$SECONDS
    python3 - "$out/work" "${PDL:-0}" <<'PY'
import shutil, sys
from pathlib import Path

import torch

sys.path.insert(0, "scripts")
from bench_engine import LLAMA_8B, make_model  # noqa: E402

from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint

work = Path(sys.argv[1])
model = make_model(LLAMA_8B, torch.device("cuda"), work / "hf")
del model
torch.cuda.empty_cache()
convert_checkpoint(work / "hf", work / "ckpt", dtype="bfloat16", force=True)
shutil.rmtree(work / "hf")
build_engine(
    work / "ckpt", work / "engine", target="auto", force=True, preset="llama-3.1-8b-bf16",
    overrides={"pdl": sys.argv[2] == "1"},
)
shutil.rmtree(work / "ckpt")
PY
    echo "engine ready in $(( SECONDS - start )) s" >&2
  fi
fi
start=$SECONDS
ingot bench --engine-dir "$engine" --grid standard --baseline hf --output-dir "$out" --force "$@"
echo "grid done in $(( SECONDS - start )) s; results in $out/grid-standard.{json,md,png}" >&2
