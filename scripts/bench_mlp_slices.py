"""An FP8 engine's MLP over a prefill chunk's rows, whole and in row slices.

A mixed step of 8,192 rows writes gate_up's bf16 output (470 MB a layer at Llama-3.1-8B's
shapes) to memory and the SwiGLU-quantize kernel reads it back: ~11% of 2,048/128's GPU time
went to such kernels (H100 profile, 2026-12-06). The MLP's rows are independent, so it can run
in slices whose gate_up output (29 MB at 512 rows) may stay in L2 for the SwiGLU kernel, at the
cost of GEMMs over fewer rows (cuBLASLt's FP8 gate_up at 512 rows ran at 1,467 TFLOP/s on the
H200, against 1,336 at 8,192: the benchmark alone, 2026-12-06). Per slice size: the MLP (add +
norm-quantize, gate_up, SwiGLU-quantize, down, fast accumulation as the throughput engines
build it) and its two GEMMs alone, median of the device time (L2 flushed before each call).

    python3 scripts/bench_mlp_slices.py --out mlp_slices.json      # on the H200, ~20 s
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import BF16, DEV, INTER, D, bench_cli  # noqa: E402

from ingot.plugins.quant import cuda_fp8  # noqa: E402
from ingot.plugins.quant import triton_quantize as tq  # noqa: E402
from ingot.plugins.tactics import _median_ms  # noqa: E402

F8 = torch.float8_e4m3fn
TOKENS = 8192
SLICES = (8192, 4096, 2048, 1024, 512, 256)


def weights():
    def fp8(n, k):
        return (torch.randn(n, k, device=DEV) * 0.02).to(F8)

    scale = torch.tensor(0.01, device=DEV)
    return {"norm": torch.rand(D, device=DEV, dtype=BF16) + 0.5, "gate_up": fp8(2 * INTER, D),
            "down": fp8(D, INTER), "scale": scale}  # fmt: skip


def mlp_in_slices(x, res, w, linear, rows: int, gemms_only: bool = False):
    """The MLP over x's rows `rows` at a time (the residual updated in place, as the engine's
    add + norm kernel does); gemms_only: gate_up and down alone on already-quantized inputs."""
    s = w["scale"]
    for a in range(0, x.shape[0], rows):
        if gemms_only:
            xq, act = x[a : a + rows], res[a : a + rows]
            linear(xq, w["gate_up"], s, s, out_dtype=BF16)
            linear(act, w["down"], s, s, out_dtype=BF16)
            continue
        r = res[a : a + rows]
        xq, _ = tq.rms_norm_quant_fp8(x[a : a + rows], w["norm"], 1e-5, s, r, residual_out=r)
        gate_up = linear(xq, w["gate_up"], s, s, out_dtype=BF16)
        act = tq.swiglu_quant_fp8(gate_up, s)
        linear(act, w["down"], s, s, out_dtype=BF16)


def main() -> None:
    args, bw = bench_cli(__doc__, "mlp_slices.json", 20)
    w = weights()
    linear = cuda_fp8.make_fp8_linear(
        cuda_fp8.fast_accum_tactic(cuda_fp8.FP8_GEMM_TACTICS[0], "1-")
    )
    x = torch.randn(TOKENS, D, device=DEV, dtype=BF16)
    res = torch.randn(TOKENS, D, device=DEV, dtype=BF16)
    xq = x.to(F8)
    act = torch.randn(TOKENS, INTER, device=DEV).to(F8)
    flops = 2 * TOKENS * D * 3 * INTER
    rows = []
    for s in SLICES:
        for kind, fn in (
            ("mlp_fp8", lambda s=s: mlp_in_slices(x, res, w, linear, s)),
            ("mlp_fp8_gemms_only", lambda s=s: mlp_in_slices(xq, act, w, linear, s, True)),
        ):
            ms = _median_ms(fn, args.reps)
            rows.append({"kernel": kind, "shape": f"T={TOKENS} slice={s}", "ms": ms,
                         "TFLOPs": flops / (ms * 1e-3) / 1e12})  # fmt: skip
            print(f"{kind:20s} {TOKENS} rows in slices of {s:5d}: {ms * 1e3:8.1f} us "
                  f"{flops / (ms * 1e-3) / 1e12:6.0f} TFLOP/s")  # fmt: skip
    doc = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
