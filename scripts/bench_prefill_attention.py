"""Prefill attention of one 2,048-token prompt (the TTFT-at-2,048 workload) on the engine's
block size, every prefill tactic plus wider candidates, L2 flushed (`plugins.tactics`); and
the batch-1 decode tactics at a 256-key context. µs and TFLOP/s per tactic, JSON.

    python3 scripts/bench_prefill_attention.py --out bench_prefill_attention.json
"""

from __future__ import annotations

import json
import math

from bench_kernels import HD, HQ, bench_cli, fixed, paged

from ingot.plugins.attention import triton_decode as dec
from ingot.plugins.attention import triton_prefill as pf
from ingot.plugins.registry import Tactic
from ingot.plugins.tactics import time_tactics

BS = 32  # build-engine's default tokens per block (the benchmarked engines')


def tactic(bm: int, bn: int, w: int, s: int) -> Tactic:
    p = (("block_m", bm), ("block_n", bn), ("num_warps", w), ("num_stages", s))
    return Tactic(f"m{bm}_n{bn}_w{w}_s{s}", p)


EXTRA = (
    tactic(128, 128, 8, 3),
    tactic(128, 64, 4, 3),
    tactic(64, 64, 4, 3),
    tactic(64, 64, 4, 2),
    tactic(128, 32, 4, 3),
    tactic(64, 128, 4, 2),
)


def main() -> None:
    args, bw = bench_cli(__doc__, "bench_prefill_attention.json", 20)
    scale = 1 / math.sqrt(HD)
    out = {"copy_bandwidth_bytes_s": bw, "tokens_per_block": BS, "prefill_2048": {}}
    n = 2048
    q, kc, vc, bt, cl, qsl = paged([n], [n], bs=BS)
    flops = 4 * HD * HQ * n * (n + 1) / 2
    cands = pf.PREFILL_TACTICS + EXTRA
    res = time_tactics(
        "paged_attention", cands, fixed((q, kc, vc, bt, cl, qsl, scale), {"max_query_len": n}),
        args.reps, factory=pf.make_prefill_attention,
    )  # fmt: skip
    for t, ms in res:
        out["prefill_2048"][t.name] = {"us": round(ms * 1e3, 1), "TFLOPs": flops / ms / 1e9}
        print(f"prefill 2048  {t.name:22s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s")
    q, kc, vc, bt, cl, qsl = paged([256], [1], bs=BS)
    res = time_tactics(
        "paged_attention", dec.DECODE_TACTICS,
        fixed((q, kc, vc, bt, cl, qsl, scale), {"max_context_len": 4096}), args.reps,
        factory=dec.make_decode_attention,
    )  # fmt: skip
    out["decode_b1_ctx256"] = {t.name: round(ms * 1e3, 2) for t, ms in res}
    for t, ms in res[:4]:
        print(f"decode b1 ctx256 {t.name:30s} {ms * 1e3:6.2f} us")
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
