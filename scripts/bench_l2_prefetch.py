"""How much faster a decode GEMV runs when the first part of its weight is already in L2.

A batch-1 decode step leaves DRAM idle while its small kernels run (attention, norms, RoPE:
~18 µs per layer on the H200, docs/performance.md). Weights never depend on the step's data,
so a side stream could read the next GEMV's first megabytes into L2 in that time. This script
measures the payoff before any engine code is written: per Llama-3.1-8B layer site, the GEMV's
device time after L2 is flushed and then the first `fraction` of its weight rows is read (by a
separate kernel), and how long that read takes on its own.

Each figure is CUDA-graph timed: (graph of `calls` x [flush, read, gemv]) minus (graph of
`calls` x [flush, read]), per call; the read alone is [flush, read] minus [flush].

`overlap`: what a bulk L2 prefetch (`cp.async.bulk.prefetch.L2`, SM 90+) of the GEMV's first
MB on a side stream saves when it runs beside a stand-in for the small kernels (a spin kernel of
`gap_us` on one SM, DRAM idle): [flush, spin, gemv] vs [flush, (spin || prefetch), gemv].
(An engine option built on it, 2026-12-03, moved batch-1 BF16 decode by +0.6%, within the
spread between runs, and was taken out again: docs/performance.md.)

    python3 scripts/bench_l2_prefetch.py --out l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from bench_gemv import graph_ms  # scripts/ is on sys.path when a script runs

from ingot.plugins.gemm import cuda as gemm

SITES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)
L2_LIMIT = 40 * 1024**2  # read at most this much ahead: the H200's L2 is 50 MB
GAPS_US = (3, 10)  # the small kernels before a layer's GEMVs: ~3 µs (a norm), ~10 (attention)
PREFETCH_MB = (8, 16, 24)


def steps_ms(steps: list[Callable[[], None]], calls: int, repeats: int) -> float:
    """Median device milliseconds of one CUDA-graph replay of `calls` x steps."""

    def run() -> None:
        for _ in range(calls):
            for step in steps:
                step()

    return graph_ms(run, repeats)


def site_rows(n: int, k: int, tactic, calls: int, repeats: int) -> list[dict]:
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    flush = torch.empty(128 * 1024**2 // 4, dtype=torch.int32, device="cuda")
    linear = gemm.make_linear(tactic)
    rows_per_mb = 1024**2 / (k * 2)
    base = steps_ms([flush.zero_], calls, repeats)
    result = []
    for f in FRACTIONS:
        rows = min(int(n * f), int(L2_LIMIT / (k * 2)))
        prefix = w[:rows]

        def read(prefix=prefix) -> None:
            if prefix.shape[0]:
                torch.sum(prefix, dim=(0, 1), dtype=torch.float32, out=sink)  # into L2; unused

        with_read = steps_ms([flush.zero_, read], calls, repeats)
        with_gemv = steps_ms([flush.zero_, read, lambda: linear(x, w, None, out)], calls, repeats)
        result.append(
            {
                "fraction": f,
                "read_mb": round(rows / rows_per_mb, 2),
                "read_us": round((with_read - base) / calls * 1e3, 2),
                "gemv_us": round((with_gemv - with_read) / calls * 1e3, 2),
            }
        )
    return result


LANES = 32  # bulk prefetches per program (one warp, one each)


@triton.jit
def _l2_prefetch_kernel(ptr, lane_bytes, total_bytes, LANES: tl.constexpr):
    """Lane i of program p prefetches bytes [j * lane_bytes, ...) of ptr, j = p * LANES + i,
    clipped to total_bytes (all multiples of 16, as the instruction requires); the program
    exits while the copy engine fetches."""
    j = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = j.to(tl.int64) * lane_bytes
    size = tl.minimum(total_bytes - start, lane_bytes).to(tl.int32)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def l2_prefetch(w: torch.Tensor, max_bytes: int, lane: int = 16 * 1024) -> None:
    """Bulk L2 prefetches for the first min(max_bytes, size of w) bytes of contiguous `w`."""
    total = min(max_bytes, w.numel() * w.element_size()) // 16 * 16
    grid = (triton.cdiv(triton.cdiv(total, lane), LANES),)
    _l2_prefetch_kernel[grid](w.view(-1).view(torch.uint8), lane, total, LANES=LANES, num_warps=1)


def spin_cycles(us: float) -> int:
    """Clock cycles of a `us`-microsecond spin at the device's clock."""
    ghz = torch.cuda.get_device_properties(0).clock_rate / 1e6  # kHz -> GHz
    return int(us * 1e3 * ghz)


def overlap_rows(n: int, k: int, tactic, calls: int, repeats: int) -> list[dict]:
    """µs per call of [flush, spin, gemv] with and without a side-stream prefetch of the
    GEMV's first MB issued as the spin starts."""
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    flush = torch.empty(128 * 1024**2 // 4, dtype=torch.int32, device="cuda")
    linear = gemm.make_linear(tactic)
    side = torch.cuda.Stream()
    rows = []
    for gap in GAPS_US:
        cycles = spin_cycles(gap)

        def plain(cycles=cycles) -> None:
            flush.zero_()
            torch.cuda._sleep(cycles)
            linear(x, w, None, out)

        base = steps_ms([plain], calls, repeats)
        for mb in PREFETCH_MB:

            def prefetched(cycles=cycles, mb=mb) -> None:
                flush.zero_()
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    l2_prefetch(w, mb * 1024**2)
                torch.cuda._sleep(cycles)
                linear(x, w, None, out)
                main.wait_stream(side)

            t = steps_ms([prefetched], calls, repeats)
            rows.append(
                {
                    "gap_us": gap,
                    "prefetch_mb": mb,
                    "plain_us": round(base / calls * 1e3, 2),
                    "prefetched_us": round(t / calls * 1e3, 2),
                    "saved_us": round((base - t) / calls * 1e3, 2),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    # the builder's usual pick at these sites on the H200 (docs/bench/bench-engine.json)
    tactic = next(t for t in gemm.GEMM_TACTICS if t.name == "gemv_n2_k2048_w8_s1_u2")
    out = {
        "device": torch.cuda.get_device_name(),
        "tactic": tactic.name,
        "sites": {
            name: site_rows(n, k, tactic, args.calls, args.repeats)
            for name, (n, k) in SITES.items()
        },
        "overlap": {
            name: overlap_rows(n, k, tactic, args.calls, args.repeats)
            for name, (n, k) in SITES.items()
        },
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for name, rows in out["sites"].items():
        cells = ", ".join(f"{r['read_mb']} MB: {r['gemv_us']} µs" for r in rows)
        print(f"{name}: {cells}")
    for name, rows in out["overlap"].items():
        cells = ", ".join(
            f"gap {r['gap_us']} µs + {r['prefetch_mb']} MB: {r['saved_us']} µs saved" for r in rows
        )
        print(f"overlap {name} ({rows[0]['plain_us']} µs plain at the first gap): {cells}")


if __name__ == "__main__":
    main()
