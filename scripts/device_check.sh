#!/usr/bin/env bash
# One round on the GPU machine: install ingot, then run the chosen stages, writing logs and JSON
# under $OUT (the device tool's output folder), packed at the end into $OUT/results.tgz (the
# tool returns 8 files at most; unpack with `tar xzf .../results.tgz -C DIR` here). Each stage
# fits one 10-minute device call.
#
# Usage: bash scripts/device_check.sh STAGE...
#   tests    every `pytest -m gpu` test (kernels, AOT bundles, GPU engines end to end)   ~6 min
#            (TESTS="tests/test_x.py ..." runs a subset, TESTS_K="expr" pytest's -k; TESTS_TIMEOUT,
#            default 480 s)
#   tests-kernels / tests-e2e   the kernel tests / the engine tests alone, when one call
#            cannot hold both beside another stage                                       ~3 min each
#   kernels  kernel micro-benchmarks (bench_kernels.json, bench_gemv.json with FP8)      ~3 min
#   bench    Llama-3.1-8B-shaped engine vs transformers eager, batch-1 variants A/B (bench_engine.json) ~4 min
#   w4       W4A16 GEMV at batch 1, every decode tactic, the small- and mid-batch halves at
#            8, 16 and 64 rows (bench_w4a16.json), and the W4A16
#            GEMM path at 128 and 2,048 rows (bench_w4a16_prefill.json)                  ~2 min
#   attn     prefill attention at 2,048 tokens, every tactic and wider ones (BF16 cache; FP8
#            cache with and without fp8_queries); batch-1 decode attention at 256 keys
#            (bench_prefill_attention.json; BLOCK_SIZES="32 64 128" repeats them at each KV
#            block size)                                                                  ~2 min per size
#   attnshort  the attn stage's short prompts alone: 64 prompts of 128 tokens on the FP8 cache,
#            every prefill tactic and GQA-packed / narrower tiles (prefill_short_prompts.json) ~1 min
#   fp8gemv  the FP8 GEMM tactics at batch 1 (CUDA-core and tensor-core GEMVs, cuBLASLt) per
#            site and as a decode step's 32 layers (bench_fp8_gemv.json)                  ~1 min
#   batch    large-batch decode: attention and GEMMs at the throughput points, the FP8-MMA
#            decode experiment beside them, and 128/128's attention in a 4,096-key graph's
#            split grid, alone and after a GEMM (batch_decode.json)                      ~1 min
#   overlap  decode layers (FP8 GEMMs + FP8-cache attention) as one batch against two half
#            batches on two streams, with cuBLASLt SM carveouts (overlap.json)           ~1 min
#   ncu      Nsight Compute reports of the FP8 decode kernel at 512 x 192, one a tactic
#            (NCU_TACTICS; ncu_<tactic>.txt: pipes, issue slots, stall reasons)          ~1 min
#   gemms    the batch stage's GEMMs alone: FP8 with and without fast accumulation at the decode
#            batches and at 8,192 rows (batch_gemms.json)                               ~40 s
#   step     an FP8 step's small kernels (norm/SwiGLU/RoPE quantizing) at batch 512 and 8,192 tokens (step_kernels.json) ~1 min
#   mlp      an FP8 MLP over 8,192 rows, whole and in row slices (mlp_slices.json)      ~30 s
#   l2       decode GEMVs with the first part of their weight already in L2 (l2_prefetch.json) ~1 min
#   grid     `ingot bench --grid standard` on the same engine shape (grid-standard.*)     ~10 min
#   quant    BF16 / FP8 / INT4 AWQ engines of that shape (bench_quant.sh; MODES to split) ~9 min
#            (one call holds MODES=fp8 COMPARE_PIPELINE=1 with its three throughput points, ~450 s;
#            MODES=bf16 TPUT_MODES=none another: batch 1 beside it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/device}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NOTE: no network there: build with the preinstalled scikit-build-core/nanobind.
python3 -m pip install --no-build-isolation --no-deps -q -e . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
# ModelOpt and the packages it needs (not on that machine): wheels fetched here by
# scripts/fetch_device_wheels.sh into .whl/, carried by the device call.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.csv"
# smi.csv: SM clock and power every 500 ms through the whole call, stages.txt when each stage
# began (does an engine's decode run at a lower clock than the kernel benchmarks?)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
  --format=csv -lms 500 > "$OUT/smi.csv" 2>/dev/null & smi_all=$!
trap 'kill $smi_all 2>/dev/null' EXIT
rc=0
KERNEL_TESTS="tests/test_gpu_kernels.py tests/test_gpu_gemv.py tests/test_gpu_quant.py"
E2E_TESTS="tests/test_gpu_e2e.py tests/test_gpu_quant_e2e.py tests/test_aot.py"
gpu_tests() {  # $1: test paths; $2: log/XML name. Lists failures, then pytest's last lines.
  # $2.failures: each failure's traceback, written as it happens (tests/conftest.py)
  # OMP_NUM_THREADS: 8 workers on 16 cores; CPU-side work (calibration, CPU reference engines)
  # otherwise runs 8 x 16 threads
  OMP_NUM_THREADS=2 INGOT_FAILURE_LOG="$OUT/$2.failures" timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -m gpu -v -p no:cacheprovider -n 8 \
    --durations=15 --junitxml="$OUT/$2.xml" ${TESTS_K:+-k "$TESTS_K"} $1 > "$OUT/$2.log" 2>&1 || rc=1
  grep -E "FAILED|ERROR" "$OUT/$2.log" | head -20; tail -3 "$OUT/$2.log"
}
for stage in "${@:-tests}"; do
  echo "$(date -u +%Y/%m/%d\ %H:%M:%S) $stage" >> "$OUT/stages.txt"
  case "$stage" in
    tests) gpu_tests "${TESTS:-tests}" gpu_tests ;;
    tests-kernels) gpu_tests "$KERNEL_TESTS" gpu_tests_kernels ;;
    tests-e2e) gpu_tests "$E2E_TESTS" gpu_tests_e2e ;;
    kernels)
      timeout 120 python3 scripts/bench_kernels.py --out "$OUT/bench_kernels.json" \
        > "$OUT/bench_kernels.log" 2>&1 || rc=1
      timeout 200 python3 scripts/bench_gemv.py --out "$OUT/bench_gemv.json" \
        > "$OUT/bench_gemv.log" 2>&1 || rc=1
      tail -5 "$OUT/bench_kernels.log" "$OUT/bench_gemv.log" ;;
    w4)
      timeout 360 python3 scripts/bench_w4a16.py --out "$OUT/bench_w4a16.json" \
        > "$OUT/bench_w4a16.log" 2>&1 || rc=1
      timeout 120 python3 scripts/bench_w4a16_prefill.py --out "$OUT/bench_w4a16_prefill.json" \
        > "$OUT/bench_w4a16_prefill.log" 2>&1 || rc=1
      tail -6 "$OUT/bench_w4a16.log"; tail -9 "$OUT/bench_w4a16_prefill.log" ;;
    bench)
      # BENCH_ARGS: extra flags (default: batch-1 decode variants alternated, bench_engine.py)
      # clocks.csv: SM clock, power and temperature every 200 ms (TTFT varies with them)
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv \
        -lms 200 > "$OUT/clocks.csv" 2>/dev/null & smi=$!
      timeout "${BENCH_TIMEOUT:-540}" python3 scripts/bench_engine.py --profile \
        --out "$OUT/bench_engine.json" --work /tmp/ingot-bench --decode-tokens 128 \
        ${BENCH_ARGS---ab-rounds 3} \
        > "$OUT/bench_engine.log" 2>&1 || rc=1
      kill $smi 2>/dev/null
      tail -45 "$OUT/bench_engine.log" ;;
    attn)
      timeout $((240 * $(wc -w <<< "${BLOCK_SIZES:-32}"))) python3 scripts/bench_prefill_attention.py --out "$OUT/bench_prefill_attention.json" \
        > "$OUT/bench_prefill_attention.log" 2>&1 || rc=1
      tail -24 "$OUT/bench_prefill_attention.log" ;;
    attnshort)
      timeout 150 python3 scripts/bench_prefill_attention.py --short-only \
        --out "$OUT/prefill_short_prompts.json" > "$OUT/prefill_short_prompts.log" 2>&1 || rc=1
      tail -8 "$OUT/prefill_short_prompts.log" ;;
    fp8gemv)
      timeout 200 python3 scripts/bench_gemv.py --fp8-only --out "$OUT/bench_fp8_gemv.json" \
        > "$OUT/bench_fp8_gemv.log" 2>&1 || rc=1
      tail -12 "$OUT/bench_fp8_gemv.log" ;;
    batch)
      timeout 260 python3 scripts/bench_batch_decode.py --out "$OUT/batch_decode.json" \
        > "$OUT/batch_decode.log" 2>&1 || rc=1
      tail -8 "$OUT/batch_decode.log" ;;
    overlap)
      timeout 200 python3 scripts/bench_overlap.py --out "$OUT/overlap.json" \
        > "$OUT/overlap.log" 2>&1 || rc=1
      tail -30 "$OUT/overlap.log" ;;
    ncu)
      # Nsight Compute on one decode launch a tactic (NCU_TACTICS: DECODE_TACTICS names):
      # pipe use, issue slots, stall reasons; --clock-control none keeps the clocks as they run
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for t in ${NCU_TACTICS:-p128_n32_w1_s3_t4096 p512_n32_w1_s3_t8192_m512}; do
        timeout 150 "$ncu" --clock-control none -k regex:_decode_kernel -s 3 -c 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
          --section WarpStateStats --section SchedulerStats --section Occupancy \
          --section MemoryWorkloadAnalysis \
          --metrics "regex:sm__inst_executed_pipe_.*avg.pct_of_peak_sustained_active" \
          python3 scripts/ncu_decode.py "$t" > "$OUT/ncu_$t.txt" 2>&1 || rc=1
        echo "== $t"; grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible" \
          "$OUT/ncu_$t.txt" | head -6
      done ;;
    gemms)
      timeout 100 python3 scripts/bench_batch_decode.py --gemms-only --out "$OUT/batch_gemms.json" \
        > "$OUT/batch_gemms.log" 2>&1 || rc=1
      grep -E "^gemm fp8_cublaslt" "$OUT/batch_gemms.log" ;;
    step)
      timeout 150 python3 scripts/bench_step_kernels.py --out "$OUT/step_kernels.json" \
        > "$OUT/step_kernels.log" 2>&1 || rc=1
      tail -14 "$OUT/step_kernels.log" ;;
    mlp)
      timeout 120 python3 scripts/bench_mlp_slices.py --out "$OUT/mlp_slices.json" \
        > "$OUT/mlp_slices.log" 2>&1 || rc=1
      tail -14 "$OUT/mlp_slices.log" ;;
    l2)
      timeout 200 python3 scripts/bench_l2_prefetch.py --out "$OUT/l2_prefetch.json" \
        > "$OUT/l2_prefetch.log" 2>&1 || rc=1
      tail -6 "$OUT/l2_prefetch.log" ;;
    grid)
      # NOTE: the 16 GB engine stays in /tmp; only the grid's JSON/markdown/PNG come back.
      timeout "${GRID_TIMEOUT:-540}" bash scripts/bench_grid.sh /tmp/ingot-grid > "$OUT/grid.log" 2>&1 || rc=1
      cp /tmp/ingot-grid/grid-standard.* "$OUT/" 2>/dev/null
      tail -40 "$OUT/grid.log" ;;
    quant)
      # NOTE: results straight into $OUT/quant: a call cut short still returns the points done
      timeout "${QUANT_TIMEOUT:-540}" bash scripts/bench_quant.sh "$OUT/quant" \
        > "$OUT/quant.log" 2>&1 || rc=1
      # NOTE: copies one folder up: the device tool returns a limited count of files a folder
      cp "$OUT/quant/summary.json" "$OUT/quant_summary.json" 2>/dev/null
      [[ -f "$OUT/quant/laps_utc.txt" ]] && python3 scripts/clock_report.py "$OUT/smi.csv" \
        "$OUT/quant/laps_utc.txt" --out "$OUT/quant_clocks.json"
      tail -40 "$OUT/quant.log" ;;
    *) echo "unknown stage $stage (tests|tests-kernels|tests-e2e|kernels|bench|w4|attn|attnshort|fp8gemv|batch|overlap|ncu|gemms|step|mlp|l2|grid|quant)"; exit 2 ;;
  esac
done
# NOTE: the device tool returns at most 8 files from $OUT, 2 folders down: everything goes back
# as results.tgz alone (`tar xzf results.tgz` here; a call cut short leaves the files as they are)
kill $smi_all 2>/dev/null
tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
exit $rc
