#!/usr/bin/env bash
# Quantized engines beside the BF16 engine, one model, one run (issue: quantization benchmarks).
#
#   bash scripts/bench_quant.sh OUT_DIR [--tiny]
#
# Makes a Llama-3.1-8B-shaped model with random bf16 weights (nothing downloaded; --tiny: a
# tiny one, for a CPU smoke test), converts it three ways (bf16; fp8 with an FP8 KV cache;
# int4_awq), calibrating with ModelOpt on the GPU, builds each engine, then runs `ingot bench`:
# latency (batch 1, 128/128) for each, and for FP8 throughput at 128/128, 2048/2048 and
# 2048/128 (BF16 throughput at those shapes is in the standard grid; MODES="fp8 fp8_fa" adds the
# FP8 engine built with --fp8-fast-accum from the same checkpoint, fp8_lm_head_fa the same
# for fp8_lm_head's). Results:
# OUT_DIR/<mode>/{latency,tput_*}/*.json, OUT_DIR/<mode>/phases.json (convert and build seconds
# by phase) and OUT_DIR/summary.json (convert/build seconds, the headline figures side by side). MODES="bf16 fp8" (say) runs a subset (fp8_lm_head and
# int4_awq_lm_head: the lm_head quantized to FP8 too, not in the default set); TPUT_MODES picks the
# modes that get throughput points (default fp8), TPUT_SHAPES which (default "128x128 2048x128
# 2048x2048", input x output; the longest last, so a call cut short keeps the others);
# REQUESTS_128 / REQUESTS_2048 / REQUESTS_LONG (2048/2048) set their size; PROFILE_SHAPES
# (e.g. "128x128") also profiles those points (scripts/profile_throughput.py), PROFILE_B1=1
# the batch-1 decode (OUT_DIR/profile_<mode>_<point>.json: one folder down, so they come back
# from the device); HOST_PROFILE_SHAPES the same points' host time by Python function
# (profile_throughput.py --host, OUT_DIR/host_profile_<mode>_<point>.json); SWEEP_BATCHES (e.g. "1,2,4,8") 128/128 throughput at each of those
# batch sizes (as many requests as the batch, or SWEEP_REQUESTS each: e.g. BATCH=1024
# SWEEP_BATCHES=512 SWEEP_REQUESTS=4096 compares a larger max batch with 512 on one engine); COMPARE_PIPELINE=1 also runs batch 1 and 128/128 with `--no-pipeline`;
# TPUT_AB_ENV ("NAME=value ...": a runtime switch to compare) each throughput point again under those
# environment variables (tput_<point>_ab_* in the summary);
# CALIB_SIZE / CALIB_LEN the calibration (default 16 windows of 256 tokens); BUILD_ARGS extra
# build-engine flags for every mode (e.g. "--pdl --fused-norms"); TOKENS_PER_BLOCK the engines' KV block
# size (default 32); KEEP_ENGINES ("mode ...") keeps those engines on the machine after the run and
# REUSE_ENGINES=1 runs a kept engine again (same BATCH) without the model, convert and build: a
# second call on the warm machine saves ~170 s of device time (a reused engine stays kept).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/bench_quant.sh OUT_DIR [--tiny]}
tiny=${2:-}
work=${WORK:-/tmp/ingot-quant}
mkdir -p "$out" "$work"
# BATCH: the engines' --max-batch-size. 1,024: on one H100 FP8 engine at 128/128 and 8,192
# requests, 30,609 output tok/s against 29,446 at batch 512 (docs/performance.md, 2026-12-07);
# the 2,048-token points hold fewer requests than either, so only 128/128 changes
device=cuda target=auto batch=${BATCH:-1024}
# NOTE: TensorRT-LLM's published offline figures use 30,000 requests at 128/128, 3,000 at
# 2048/128 and 1,500 at 2048/2048 (docs/source/performance/perf-overview.md), so that the batch
# stays full; these defaults are what one 10-minute device call holds (at least the engine's
# max batch at 128/128: 8,192 requests, 8 waves of 1,024), so the ramp-up and the drain weigh
# more here.
# 2048/2048: at most as many requests as the FP8 pool holds at once (59,785 blocks of 32 tokens
# on the H200 = 467 sequences of 4,096 tokens), so that every request decodes in one batch
# rather than a few dozen decoding alone after the others finish.
requests_128=${REQUESTS_128:-8192} requests_2048=${REQUESTS_2048:-512}
requests_long=${REQUESTS_LONG:-448}
# NOTE: a speed benchmark of random weights: the calibration size changes no speed figure,
# only the convert time (FP8 at 32 x 512 tokens: 140 s, against 45 s for BF16's convert)
calib=(--calib-size "${CALIB_SIZE:-16}" --calib-max-seq-len "${CALIB_LEN:-256}" --device cuda)
if [[ "$tiny" == "--tiny" ]]; then
  device=cpu target=cpu requests_128=8 requests_2048=2 requests_long=2 batch=8
  calib=(--calib-size 4 --calib-max-seq-len 64 --device cpu)
fi
timings="$out/timings.txt"
: > "$timings"; : > "$out/laps_utc.txt"
# laps_utc.txt: when each phase ended, beside device_check.sh's smi.csv (clocks, power)
lap() { echo "$1 $(( SECONDS - start ))" >> "$timings"; echo "$1 $(date -u +%H:%M:%S)" >> "$out/laps_utc.txt"; }

# summary.json from what is there so far: written after every throughput point too, so a call
# cut short by its time limit still returns the points done (the folders below $out/<mode>
# are too deep for the device tool); "print" also prints the headline figures
summarize() {
  python3 - "$out" "${1:-}" <<'PY'
import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
summary = {"seconds": dict(line.split() for line in (out / "timings.txt").read_text().splitlines()),
           "tput_ab_env": os.environ.get("TPUT_AB_ENV")}
for mode in ("bf16", "fp8", "fp8_fa", "fp8_lm_head", "fp8_lm_head_fa", "int4_awq",
             "int4_awq_lm_head"):
    if not (out / mode / "latency.json").is_file():
        continue
    lat = json.loads((out / mode / "latency.json").read_text())["results"][0]["ingot"]
    row = {"decode_b1_tok_s": lat["decode_tok_s_per_request"]["mean"],
           "decode_roofline": lat["decode"], "latency": lat}
    if (out / mode / "phases.json").is_file():  # seconds by phase: convert and build
        row["phases_s"] = json.loads((out / mode / "phases.json").read_text())
    off = out / mode / "no_pipeline"
    if (off / "latency.json").is_file():  # COMPARE_PIPELINE
        lat_off = json.loads((off / "latency.json").read_text())["results"][0]["ingot"]
        row["decode_b1_tok_s_no_pipeline"] = lat_off["decode_tok_s_per_request"]["mean"]
    # the throughput points, and (COMPARE_PIPELINE) the same points unpipelined
    for where, tag in ((out / mode, ""), (off, "_no_pipeline")):
        for p in sorted(where.glob("tput_*/throughput.json")):
            res = json.loads(p.read_text())["results"][0]["ingot"]
            row[p.parent.name + tag + "_output_tok_s"] = res["output_tok_s"]
            # where the run's time went: decode-only / prefill-only / mixed steps
            row[p.parent.name + tag + "_step_mix"] = res.get("step_mix")
            row[p.parent.name + tag + "_decode_tok_s"] = (res.get("decode") or {}).get("tok_s")
            # time to first token and the queue wait inside it (all requests arrive at once)
            row[p.parent.name + tag + "_ttft_queue_p50_ms"] = [
                (res.get(k) or {}).get("p50") for k in ("ttft_ms", "queue_ms")]
            # the caching allocator's device-wide waits (retries) and cudaMalloc/cudaFree calls
            row[p.parent.name + tag + "_allocator"] = res.get("allocator")
    sweep = out / f"{mode}_sweep" / "throughput.json"
    if sweep.is_file():  # SWEEP_BATCHES: 128/128 at each batch size
        row["sweep"] = {
            str(r["batch_size"]): {
                "decode_tok_s": (r["ingot"].get("decode") or {}).get("tok_s"),
                "output_tok_s": r["ingot"]["output_tok_s"],
                "itl_p50_ms": r["ingot"]["itl_ms"]["p50"],
                "ttft_p50_ms": r["ingot"]["ttft_ms"]["p50"],
                "queue_p50_ms": (r["ingot"].get("queue_ms") or {}).get("p50"),
            }
            for r in json.loads(sweep.read_text())["results"]
        }
    summary[mode] = row
(out / "summary.json").write_text(json.dumps(summary, indent=2))
if sys.argv[2] == "print":
    print(json.dumps({m: {k: v for k, v in r.items() if k != "latency"}
                      for m, r in summary.items() if m not in ("seconds", "tput_ab_env")}, indent=2))
PY
}

start=$SECONDS
# REUSE_ENGINES=1: a mode whose engine a call before kept (KEEP_ENGINES, same warm machine) and
# built for this BATCH skips the model, its convert and its build (~170 s of device time)
reused() {
  [[ -n "${REUSE_ENGINES:-}" && -f "$work/engine-$1/config.json" ]] && python3 -c '
import json, sys
sys.exit(json.load(open(sys.argv[1]))["build"]["max_batch_size"] != int(sys.argv[2]))
' "$work/engine-$1/config.json" "$batch"
}
all_reused=1
for mode in ${MODES:-bf16 fp8 int4_awq}; do reused "$mode" || all_reused=0; done
if (( all_reused )); then echo "reusing the kept engines of ${MODES:-}"; else
python3 - "$work/hf" "$device" "$tiny" <<'PY'
import sys
from pathlib import Path

import torch

sys.path.insert(0, "scripts")
from bench_engine import LLAMA_8B, TINY, make_model  # noqa: E402

shape = dict(TINY, hidden_size=128, intermediate_size=256) if sys.argv[3] else LLAMA_8B
make_model(shape, torch.device(sys.argv[2]), Path(sys.argv[1]))
PY
fi
lap make_model

declare -A quant=([bf16]="" [fp8]="--quant fp8 --kv-cache-dtype fp8" [int4_awq]="--quant int4_awq"
  [fp8_lm_head]="--quant fp8 --kv-cache-dtype fp8 --quant-lm-head"
  [int4_awq_lm_head]="--quant int4_awq --quant-lm-head")
# modes that build another engine from a mode's checkpoint: fp8_fa is fp8 built with
# --fp8-fast-accum (after fp8 in MODES, it reuses fp8's checkpoint: one convert for both)
declare -A ckpt_of=([fp8_fa]=fp8 [fp8_lm_head_fa]=fp8_lm_head) \
  build_of=([fp8_fa]="--fp8-fast-accum" [fp8_lm_head_fa]="--fp8-fast-accum")
modes=(${MODES:-bf16 fp8 int4_awq})
for m in "${!modes[@]}"; do
  mode=${modes[$m]} base=${ckpt_of[${modes[$m]}]:-${modes[$m]}}
  start=$SECONDS
  if reused "$mode"; then
    lap "reused_$mode"
  else
    if [[ ! -d "$work/ckpt-$base" ]]; then
      # shellcheck disable=SC2086  # the quant flags split into words on purpose
      ingot convert-checkpoint --model-dir "$work/hf" --output-dir "$work/ckpt-$base" --force \
        ${quant[$base]} $( [[ -n "${quant[$base]}" ]] && echo "${calib[@]}" )
    fi
    lap "convert_$mode"
    start=$SECONDS
    # shellcheck disable=SC2086  # BUILD_ARGS: flags split into words on purpose
    ingot build-engine --checkpoint-dir "$work/ckpt-$base" --output-dir "$work/engine-$mode" \
      --target "$target" --max-batch-size "$batch" --max-seq-len 4096 --max-num-tokens 8192 \
      --tokens-per-block "${TOKENS_PER_BLOCK:-32}" --force ${BUILD_ARGS:-} ${build_of[$mode]:-}
    lap "build_$mode"
    # where the convert's and the build's time went, phase by phase (before both are deleted)
    mkdir -p "$out/$mode"
    python3 - "$work/ckpt-$base/config.json" "$work/engine-$mode/config.json" \
      > "$out/$mode/phases.json" <<'PY'
import json
import sys

ckpt, engine = (json.load(open(p)) for p in sys.argv[1:])
# the tactic picked per op and GEMM site, and the timings that picked it
tactics = {p["name"] + (f"@{p['site']}" if p["site"] else ""): {"tactic": p["tactic"],
           "ms": p["timings_ms"]} for p in engine["plugins"]}
print(json.dumps({"convert": (ckpt.get("quant_report") or {}).get("seconds"),
                  "build": engine["extra"].get("build_seconds"), "tactics": tactics}, indent=2))
PY
    # NOTE: a checkpoint goes once no later mode builds from it (disk: 16 GB for BF16)
    keep=0
    for later in "${modes[@]:$((m + 1))}"; do
      [[ "${ckpt_of[$later]:-$later}" == "$base" ]] && keep=1
    done
    (( keep )) || rm -rf "$work/ckpt-$base"
  fi
  ingot bench --engine-dir "$work/engine-$mode" latency --input-len 128 --output-len 128 \
    --output-dir "$out/$mode" --force
  if [[ -n "${COMPARE_PIPELINE:-}" ]]; then  # the same point with the executor unpipelined
    ingot bench --engine-dir "$work/engine-$mode" latency --input-len 128 --output-len 128 \
      --output-dir "$out/$mode/no_pipeline" --no-pipeline --force
  fi
  if [[ -n "${SWEEP_BATCHES:-}" ]]; then  # small batches: 128/128 at each batch size, e.g. 1,2,4,8
    # NOTE: a folder beside $out/$mode: the device tool returns files at most 2 folders down
    ingot bench --engine-dir "$work/engine-$mode" throughput --input-len 128 --output-len 128 \
      --batch-sizes "$SWEEP_BATCHES" ${SWEEP_REQUESTS:+--num-requests "$SWEEP_REQUESTS"} \
      --output-dir "$out/${mode}_sweep" --force
  fi
  if [[ -n "${PROFILE_B1:-}" ]]; then  # the batch-1 decode step's GPU time by kernel group
    python3 scripts/profile_throughput.py "$work/engine-$mode" --input-len 128 --output-len 128 \
      --num-requests 1 --out "$out/profile_${mode}_b1.json"
  fi
  # the throughput point $i/$o ($n requests) of this mode's engine into folder $1 (more flags:
  # the rest)
  tput() {
    echo "start ${1#"$out/"} $(date -u +%H:%M:%S)" >> "$out/laps_utc.txt"
    ingot bench --engine-dir "$work/engine-$mode" throughput --input-len "$i" \
      --output-len "$o" --num-requests "$n" --force --output-dir "$@"
    echo "end ${1#"$out/"} $(date -u +%H:%M:%S)" >> "$out/laps_utc.txt"
    summarize
  }
  if [[ " ${TPUT_MODES:-fp8} " == *" $mode "* ]]; then
    for shape in ${TPUT_SHAPES:-128x128 2048x128 2048x2048}; do
      i=${shape%x*} o=${shape#*x}
      n=$(( i >= 2048 ? (o >= 2048 ? requests_long : requests_2048) : requests_128 ))
      tput "$out/$mode/tput_${i}_${o}"
      if [[ -n "${TPUT_AB_ENV:-}" ]]; then  # the same point under those variables (an A/B)
        # shellcheck disable=SC2086  # VAR=value words on purpose
        (export $TPUT_AB_ENV; tput "$out/$mode/tput_${i}_${o}_ab")
      fi
      if [[ -n "${COMPARE_PIPELINE:-}" && "$shape" == "128x128" ]]; then
        tput "$out/$mode/no_pipeline/tput_${i}_${o}" --no-pipeline
      fi
      if [[ " ${HOST_PROFILE_SHAPES:-} " == *" $shape "* ]]; then  # the host's side (cProfile)
        python3 scripts/profile_throughput.py "$work/engine-$mode" --input-len "$i" --host \
          --output-len "$o" --num-requests "$n" --out "$out/host_profile_${mode}_${i}_${o}.json"
      fi
      if [[ " ${PROFILE_SHAPES:-} " == *" $shape "* ]]; then
        python3 scripts/profile_throughput.py "$work/engine-$mode" --input-len "$i" \
          --output-len "$o" --num-requests "$n" --out "$out/profile_${mode}_${i}_${o}.json"
      fi
    done
  fi
  # NOTE: 16 GB each on the GPU machine's disk; KEEP_ENGINES="mode ..." keeps those for a
  # next call's REUSE_ENGINES, and an engine this call reused stays for the call after it (a
  # second call without KEEP_ENGINES removed it and the third rebuilt it: ~200 s of device time)
  [[ " ${KEEP_ENGINES:-} " == *" $mode "* ]] || reused "$mode" || rm -rf "$work/engine-$mode"
done
summarize print
