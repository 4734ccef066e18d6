"""W4A16 (INT4 AWQ, group 128) GEMM path at prefill sizes on the Llama-3.1-8B layer shapes: the
best GEMM tactic's median time per site at T = 128 and 2,048 rows (L2 flushed between calls),
every tactic's under `all_ms` (the Triton GEMMs and the dequantize-then-cuBLAS one).

    python3 scripts/bench_w4a16_prefill.py --out bench_w4a16_prefill.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import BF16, DEV, bench_cli, fixed  # noqa: E402
from bench_w4a16 import GROUP, SHAPES  # noqa: E402

from ingot.plugins.quant import triton_w4a16 as tw  # noqa: E402
from ingot.plugins.tactics import time_tactics  # noqa: E402


def main() -> None:
    args, _ = bench_cli(__doc__, "bench_w4a16_prefill.json", 20)
    tactics = [tw.combine_tactics(tw.DECODE_TACTICS[0], m) for m in tw.GEMM_TACTICS]
    best = {}
    for T in (128, 2048):
        for name, (N, K) in SHAPES.items():
            x = torch.randn(T, K, device=DEV, dtype=BF16)
            w = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), device=DEV, dtype=torch.int32)
            s = (torch.rand(N, K // GROUP, device=DEV) * 0.02 + 0.005).to(BF16)
            pqs = (torch.rand(K, device=DEV) + 0.5).to(BF16)
            t = time_tactics("w4a16_gemm", tactics, fixed((x, w, s, pqs, GROUP), {}), args.reps,
                             factory=tw.make_w4a16_linear)  # fmt: skip
            best[f"{name}_T{T}"] = {"tactic": t[0][0].name, "ms": t[0][1],
                                    "all_ms": {c.name: ms for c, ms in t}}  # fmt: skip
            print(f"{name:8s} T={T:5d} {t[0][0].name:45s} {t[0][1] * 1e3:8.1f} us", flush=True)
    args.out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "best": best}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
