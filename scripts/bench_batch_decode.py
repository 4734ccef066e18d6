"""Where a large-batch decode step's time goes (the FP8 throughput points of the quantization
issue): decode attention at the batch and context of each point, BF16 and FP8 KV cache, every
tactic; the layer GEMMs at that batch (FP8 through cuBLASLt with and without the quantize
kernel, each with and without fast accumulation, BF16 through torch; also at a prefill
chunk's 8,192 rows); and their sum per step beside the bytes the step must read.

    python3 scripts/bench_batch_decode.py --out batch_decode.json

Shapes: Llama-3.1-8B. Points (batch, context, rows the step launches): (128, 3072) is the
middle of 2048/2048 at 128 requests, (448, 3072) at 448; (435, 3072) as that run's decode
steps launch it: padded to a graph bucket of 512 rows (before 12-04's buckets of 64) and of
448 (the padding rows hold one token, as in the graphs; the split plan sees every row);
(128, 2112) of 2048/128; (512, 192) of 128/128 at batch 512. At each point, FP8 cache: also
the FP8-MMA experiment (plugins/attention/triton_decode_fp8mma.py), each variant's time and
its error against the decode kernel's output ("decode_attention_fp8mma" rows). 128/128's point
also in the graphs' 4,096-key split grid, and there after a gate_up GEMM ("after gate_up": the
clock the engine's decode steps run at).
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import (  # noqa: E402
    BF16,
    DEV,
    HD,
    HKV,
    HQ,
    INTER,
    LAYERS,
    VOCAB,
    D,
    bench_cli,
    fixed,
    paged,
    record,
)

from ingot.plugins.attention import triton_decode as dec  # noqa: E402
from ingot.plugins.attention import triton_decode_fp8mma as f8mma  # noqa: E402
from ingot.plugins.attention.layout import to_v_layout  # noqa: E402
from ingot.plugins.quant import cuda_fp8  # noqa: E402
from ingot.plugins.quant.row_room import empty_rows, padded_rows  # noqa: E402
from ingot.plugins.registry import Tactic  # noqa: E402
from ingot.plugins.tactics import _median_ms, time_tactics  # noqa: E402

POINTS = ((128, 3072, 128), (448, 3072, 448), (435, 3072, 512), (435, 3072, 448),
          (128, 2112, 128), (512, 192, 512))  # fmt: skip
PREFILL_ROWS = 8192
ENGINE_BS = 32  # tokens per KV block of the llama-3.1-8b presets
GRAPH_BOUND = 4096  # the decode graphs' context bound in bench_quant.sh's engines (max_seq_len)
# also "fp8_v_rows", "fp8_new_v" (measured 12-03; listed here, they are timed again)
KV_KINDS = ("bf16", "fp8")
LAYER_GEMMS = {"qkv": (HQ * HD + 2 * HKV * HD, D), "o": (D, HQ * HD), "gate_up": (2 * INTER, D),
               "down": (D, INTER)}  # fmt: skip


# (block_n, num_warps, num_stages, FP8 terms of the queries and P) of the FP8-MMA experiment
FP8MMA_VARIANTS = tuple(
    Tactic(f"fp8mma_n{n}_w{w}_s{st}_x{x}",
           (("block_n", n), ("num_warps", w), ("num_stages", st), ("two_term", x == 2)))
    for n, w, st, x in ((64, 4, 2, 2), (64, 4, 3, 2), (64, 8, 2, 2), (128, 4, 2, 2),
                        (128, 8, 2, 2), (64, 4, 2, 1), (64, 8, 2, 1))
)  # fmt: skip


def fp8_paged(B, ctx):
    """paged()'s B sequences of ctx keys, one query each, in an FP8 pool (V transposed per
    block, as FP8 pools store it), and a unit scale: q, kc, vc, bt, cl, qsl, one."""
    q, kc, vc, bt, cl, qsl = paged([ctx] * B, [1] * B, ENGINE_BS)
    kc = kc.to(torch.float8_e4m3fn)
    vc = to_v_layout(vc.to(torch.float8_e4m3fn), transposed=True)
    return q, kc, vc, bt, cl, qsl, torch.ones((), device=DEV, dtype=torch.float32)


def attention_fp8mma(rows, bw, B, ctx, reps) -> None:
    """The FP8-MMA decode experiment at B sequences of ctx keys (FP8 cache, V transposed): the
    time of each variant and its relative error against the decode kernel's output (the
    production path: fp16 dots on the converted cache)."""
    q, kc, vc, bt, cl, qsl, one = fp8_paged(B, ctx)
    args = (q, kc, vc, bt, cl, 1 / math.sqrt(HD), one, one)
    t = time_tactics("decode_fp8mma", FP8MMA_VARIANTS, fixed(args, {}), reps,
                     factory=lambda tac: functools.partial(f8mma.decode_fp8mma, **tac.as_dict()))  # fmt: skip
    record(rows, "decode_attention_fp8mma", f"B={B} ctx={ctx}", t, B * ctx * HKV * HD * 2, bw=bw)
    ref = dec.make_decode_attention(None)(q, kc, vc, bt, cl, qsl, 1 / math.sqrt(HD),
                                          k_scale=one, v_scale=one).float()  # fmt: skip
    for row in rows[-len(t) :]:
        if math.isfinite(row["ms"]):
            params = next(v for v in FP8MMA_VARIANTS if v.name == row["tactic"]).as_dict()
            out = f8mma.decode_fp8mma(*args, **params).float()
            row["rel_err_vs_decode_kernel"] = float((out - ref).norm() / ref.norm())
    print(f"B={B} ctx={ctx}: fp8mma best {t[0][0].name} {t[0][1] * 1e3:.1f} us")


def attention(rows, bw, B, ctx, kv, reps, tactics=dec.DECODE_TACTICS, launched=None, bound=None):
    """kv: "bf16", "fp8" (V transposed per block, as FP8 pools store it), "fp8_v_rows" (V
    token-major like K: the layout before 12-03) or "fp8_new_v" (as "fp8", the kernel storing
    each sequence's newest V first, an option the engines leave off). launched: rows of the
    launch (B real ones, the others one-token padding), default B. bound: the context bound
    the split grid is sized for, default the block table's width (here just ctx; an engine's
    decode graphs: its max_seq_len, where short contexts leave the later splits empty)."""
    n = launched or B
    q, kc, vc, bt, cl, qsl = paged([ctx] * B + [1] * (n - B), [1] * n, ENGINE_BS)
    kw = {"max_context_len": bound or bt.shape[1] * ENGINE_BS}  # the graphs': the table's width
    elem = 2
    if kv != "bf16":
        kc, vc, elem = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), 1
        vc = to_v_layout(vc, transposed=kv != "fp8_v_rows")
        one = torch.ones((), device=DEV, dtype=torch.float32)
        kw |= {"k_scale": one, "v_scale": one}
        if kv == "fp8_new_v":
            kw["new_v"] = torch.randn(n, HKV, HD, device=DEV, dtype=BF16)
    t = time_tactics("paged_attention", tactics,
                     fixed((q, kc, vc, bt, cl, qsl, 1 / math.sqrt(HD)), kw), reps,
                     factory=dec.make_decode_attention)  # fmt: skip
    nbytes = B * ctx * HKV * HD * 2 * elem
    shape = f"B={B} ctx={ctx}" + (f" in {n} rows" if n != B else "")
    shape += f" bound={bound}" if bound else ""
    record(rows, f"decode_attention_{kv}kv", shape, t, nbytes, bw=bw)
    return t[0][1]


def attention_after_gemm(rows, bw, B, ctx, reps, bound):
    """The large-batch FP8 decode tactics at B x ctx, each timed after the 512-row gate_up
    GEMM in the same graph (charged what it adds to the GEMM alone): the engine's decode step
    runs attention between power-hungry GEMMs at the power cap (~1,590 MHz on the H100 against
    the 1,980 an attention benchmark alone gets; docs/performance.md, 12-06), and these rows
    say whether a benchmark with a GEMM beside it sees that clock."""
    q, kc, vc, bt, cl, qsl, one = fp8_paged(B, ctx)
    kw = {"max_context_len": bound, "k_scale": one, "v_scale": one}
    n, k = LAYER_GEMMS["gate_up"]
    wq = torch.randn(n, k, device=DEV, dtype=BF16).to(torch.float8_e4m3fn)
    xq = torch.randn(B, k, device=DEV, dtype=BF16).to(torch.float8_e4m3fn)
    fast = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(cuda_fp8.FP8_GEMM_TACTICS[0]))

    def gate_up():
        fast(xq, wq, one, one, out_dtype=BF16)

    timings = []
    m128 = next(t for t in dec.DECODE_TACTICS if t.name == "p128_n64_w4_s3_m128")  # H100's old pick
    for t in (*dec.LARGE_BATCH_TACTICS, m128):
        fn = dec.make_decode_attention(t)
        call = functools.partial(fn, q, kc, vc, bt, cl, qsl, 1 / math.sqrt(HD), **kw)
        timings.append((t, _median_ms(call, reps, before=gate_up)))
    timings.sort(key=lambda r: r[1])
    nbytes = B * ctx * HKV * HD * 2
    record(rows, "decode_attention_fp8kv", f"B={B} ctx={ctx} bound={bound} after gate_up",
           timings, nbytes, bw=bw)  # fmt: skip


def gemms(rows, bw, M, reps):
    """ms per call of each layer GEMM and the lm_head at M rows: FP8 (quantize + cuBLASLt, and
    cuBLASLt alone on an already-quantized x, each also with fast accumulation: engines built
    with --fp8-fast-accum) and BF16 (torch)."""
    out = {}
    s = torch.ones((), device=DEV, dtype=torch.float32)
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    fp8 = cuda_fp8.make_fp8_linear(t)
    fast = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(t))
    pad = Tactic(t.name, t.params + (("pad_rows", "1-"),))  # rows padded to a multiple of 128
    padded = {"": cuda_fp8.make_fp8_linear(pad),
              "_fast_accum": cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(pad, "1-"))}  # fmt: skip
    for name, (N, K) in {**LAYER_GEMMS, "lm_head": (VOCAB, D)}.items():
        w = torch.randn(N, K, device=DEV, dtype=BF16)
        x = torch.randn(M, K, device=DEV, dtype=BF16)
        wq, xq = w.to(torch.float8_e4m3fn), x.to(torch.float8_e4m3fn)
        calls = {
            "fp8_quantize_cublaslt": lambda x=x, wq=wq: fp8(x, wq, s, s),
            "fp8_cublaslt": lambda xq=xq, wq=wq: fp8(xq, wq, s, s, out_dtype=BF16),
            "fp8_quantize_cublaslt_fast_accum": lambda x=x, wq=wq: fast(x, wq, s, s),
            "fp8_cublaslt_fast_accum": lambda xq=xq, wq=wq: fast(xq, wq, s, s, out_dtype=BF16),
            "bf16_torch": lambda x=x, w=w: torch.nn.functional.linear(x, w),
        }
        if padded_rows(M) != M:  # on the room the quantizing kernels leave (row_room)
            xr = empty_rows(M, K, torch.float8_e4m3fn, DEV)
            xr.copy_(xq)
            for mode, fn in padded.items():
                calls[f"fp8_cublaslt{mode}_padded"] = lambda xr=xr, wq=wq, fn=fn: fn(
                    xr, wq, s, s, out_dtype=BF16
                )
        for how, fn in calls.items():
            ms = _median_ms(fn, reps)
            nbytes = N * K * (1 if how.startswith("fp8") else 2) + M * (K + N) * 2
            rows.append({"kernel": f"gemm_{how}", "shape": f"{name} M={M} N={N} K={K}", "ms": ms,
                         "bytes": nbytes, "GBps": nbytes / (ms * 1e-3) / 1e9,
                         "TFLOPs": 2 * M * N * K / (ms * 1e-3) / 1e12})  # fmt: skip
            out[(name, how)] = ms
            print(f"gemm {how:22s} {name:8s} M={M:4d}: {ms * 1e3:8.1f} us "
                  f"{nbytes / (ms * 1e-3) / bw * 100:5.1f}% bw "
                  f"{2 * M * N * K / (ms * 1e-3) / 1e12:6.0f} TFLOP/s")  # fmt: skip
    return out


def main() -> None:
    args, bw = bench_cli(__doc__, "batch_decode.json", 20,
                         (("--gemms-only", "time the GEMMs, not the attention points"),))  # fmt: skip
    rows, points = [], []
    gemm_ms = {M: gemms(rows, bw, M, args.reps) for M in sorted({m for _, _, m in POINTS})}
    gemms(rows, bw, PREFILL_ROWS, args.reps)  # a full prefill chunk (max_num_tokens 8,192)
    for B, ctx, M in () if args.gemms_only else POINTS:
        attn = {kv: attention(rows, bw, B, ctx, kv, args.reps, launched=M) for kv in KV_KINDS}
        if M == B:
            attention_fp8mma(rows, bw, B, ctx, args.reps)
        g = gemm_ms[M]
        layer_fp8 = sum(g[(n, "fp8_quantize_cublaslt")] for n in LAYER_GEMMS)
        layer_fast = sum(g[(n, "fp8_quantize_cublaslt_fast_accum")] for n in LAYER_GEMMS)
        step_ms = LAYERS * (layer_fp8 + attn["fp8"]) + g[("lm_head", "bf16_torch")]
        kv_bytes = B * ctx * HKV * HD * 2 * LAYERS  # fp8 cache
        w_bytes = LAYERS * sum(n * k for n, k in LAYER_GEMMS.values()) + VOCAB * D * 2
        points.append({
            "batch": B, "context": ctx, "rows_launched": M, "attention_ms": attn, "fp8_layer_gemms_ms": layer_fp8,
            "fp8_layer_gemms_fast_accum_ms": layer_fast,
            "fp8_step_gemms_plus_attention_ms": step_ms, "bytes_per_step": kv_bytes + w_bytes,
            "bandwidth_floor_ms": (kv_bytes + w_bytes) / bw * 1e3,
            "tok_s_at_that_step": B / (step_ms * 1e-3),
        })  # fmt: skip
        print(f"B={B} ctx={ctx} in {M} rows: attention fp8-KV {attn['fp8'] * 1e3:.0f} us/layer, FP8 GEMMs "
              f"{layer_fp8 * 1e3:.0f} us/layer; step {step_ms:.2f} ms (floor "
              f"{points[-1]['bandwidth_floor_ms']:.2f} ms) -> {B / (step_ms * 1e-3):.0f} tok/s")  # fmt: skip
    if not args.gemms_only:  # 128/128's decode steps as the engine's graphs launch them
        for kv in KV_KINDS:
            attention(rows, bw, 512, 192, kv, args.reps, bound=GRAPH_BOUND)
        attention_after_gemm(rows, bw, 512, 192, args.reps, GRAPH_BOUND)
    doc = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
           "points": points, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
