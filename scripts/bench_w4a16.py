"""W4A16 (INT4 AWQ, group 128) GEMV at batch 1 on the Llama-3.1-8B layer shapes: every decode
tactic's median time (L2 flushed between calls), the bytes it must read (packed weights, scales,
x) against the measured copy bandwidth, and the per-layer sum of the best tactics. The down
projection is timed on [gate | up] (SwiGLU included), as engines run it (since 2026-12-05): each
GEMV gated, and its `swiglu_apart` twin (the SwiGLU kernel, then the GEMV ungated).
Then decode batches: at 8 rows the GEMM tactics against the small-batch halves (`small_batch`),
at 16 and 64 rows against the medium-batch (split-K) halves (`mid_batch`).

    python3 scripts/bench_w4a16.py --out bench_w4a16.json [--batches-only]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import BF16, DEV, HD, HKV, HQ, INTER, LAYERS, D, bench_cli, fixed, record  # noqa: E402

from ingot.plugins.quant import triton_w4a16 as tw  # noqa: E402
from ingot.plugins.tactics import time_tactics  # noqa: E402

GROUP = 128
SHAPES = {"qkv": (HQ * HD + 2 * HKV * HD, D), "o": (D, HQ * HD), "gate_up": (2 * INTER, D),
          "down": (D, INTER)}  # fmt: skip


def inputs(N: int, K: int, gated: bool = False, rows: int = 1):
    """gated: x is [gate | up], as INT4 engines run the down projection (SwiGLU as it loads,
    or a kernel before for the tensor-core tactics)."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), device=DEV, dtype=torch.int32)
    scales = (torch.rand(N, K // GROUP, device=DEV) * 0.02 + 0.005).to(BF16)
    pqs = (torch.rand(K, device=DEV) + 0.5).to(BF16)
    x = torch.randn(rows, 2 * K if gated else K, device=DEV, dtype=BF16)
    return (x, qweight, scales, pqs, GROUP), ({"gated": True} if gated else {})


def main() -> None:
    args, bw = bench_cli(__doc__, "bench_w4a16.json", 30,
                         (("--batches-only", "only the 8-64-row batches"),))  # fmt: skip
    rows, best = [], {}
    for name, (N, K) in {} if args.batches_only else SHAPES.items():
        # the build's candidates: at down also each GEMV with the SwiGLU kernel first (`_sa`)
        tactics = [tw.combine_tactics(d, tw.GEMM_TACTICS[0])
                   for d in tw.decode_candidates(name == "down")]  # fmt: skip
        t = time_tactics("w4a16_gemm", tactics, fixed(*inputs(N, K, name == "down")), args.reps,
                         factory=tw.make_w4a16_linear)  # fmt: skip
        nbytes = N * K // 2 + (K // GROUP) * N * 2 + K * 4 + N * 2
        record(rows, "w4a16_gemv", f"{name} N={N} K={K}", t, nbytes, 2 * N * K, bw=bw)
        best[name] = {
            "tactic": t[0][0].name,
            "ms": t[0][1],
            "frac_bw": nbytes / (t[0][1] * 1e-3) / bw,
        }
    small = batch_halves(rows, args.reps, bw, tw.MMA_ROWS, "small")
    mid = {T: batch_halves(rows, args.reps, bw, T, "mid") for T in (16, tw.MID_ROWS)}
    if args.batches_only:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "copy_bandwidth_Bps": bw, "small_batch": small,
                                        "mid_batch": mid, "rows": rows}, indent=1))  # fmt: skip
        return
    layer_ms = sum(b["ms"] for b in best.values())
    layer_bytes = sum(N * K // 2 for N, K in SHAPES.values())
    print(f"layer: {layer_ms * 1e3:.1f} us for {layer_bytes / 1e6:.1f} MB of packed weights "
          f"({layer_bytes / (layer_ms * 1e-3) / bw * 100:.1f}% of copy bandwidth); "
          f"{LAYERS} layers: {LAYERS * layer_ms:.2f} ms")  # fmt: skip
    doc = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "best": best,
           "layer_ms": layer_ms, "layers_ms": LAYERS * layer_ms, "small_batch": small,
           "mid_batch": mid, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


def batch_halves(rows: list, reps: int, bw: float, T: int, kind: str) -> dict:
    """A decode batch of T rows (past the GEMV's one): every GEMM tactic (what engines ran
    there without the half) against each half of `kind` per site, the down projection gated;
    the best of each. small: the tensor-core GEMV (`combine_tactics(..., small)`, up to 8
    rows); mid: the split-K GEMM (`combine_tactics(..., mid=)`, up to 64)."""
    dec, first = tw.DECODE_TACTICS[0], tw.GEMM_TACTICS[0]
    cands = [tw.combine_tactics(dec, m) for m in tw.GEMM_TACTICS]
    if kind == "small":
        cands += [tw.combine_tactics(dec, first, s) for s in tw.SMALL_TACTICS]
    else:
        cands += [tw.combine_tactics(dec, first, mid=m) for m in tw.MID_TACTICS]
    tag, out = f"+{kind}_", {}
    for name, (N, K) in SHAPES.items():
        t = time_tactics("w4a16_gemm", cands, fixed(*inputs(N, K, name == "down", T)), reps,
                         factory=tw.make_w4a16_linear)  # fmt: skip
        nbytes = N * K // 2 + (K // GROUP) * N * 2 + T * K * 4 + T * N * 2
        record(rows, f"w4a16_{kind}_batch", f"{name} T={T} N={N} K={K}", t, nbytes,
               2 * T * N * K, bw=bw)  # fmt: skip
        kinds = {"gemm": [r for r in t if tag not in r[0].name],
                 kind: [r for r in t if tag in r[0].name]}  # fmt: skip
        out[name] = {k: {"tactic": v[0][0].name, "ms": v[0][1]} for k, v in kinds.items()}
        print(f"  {name} at {T} rows: GEMM {out[name]['gemm']['ms'] * 1e3:.1f} us, "
              f"{kind}-batch half {out[name][kind]['ms'] * 1e3:.1f} us")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
