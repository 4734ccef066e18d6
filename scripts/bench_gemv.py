"""Time the GEMM tactics (Triton GEMV and cuBLAS) at Llama-3.1-8B decode shapes.

Per (site, T): every tactic's device time per call, CUDA-graph timed with L2 flushed between
calls (`plugins.tactics.time_tactics`; this includes the launch gap and the write-back of the
flush's dirty lines, so it understates small kernels), and at T=1 the steady state of cuBLAS and
the three best tactics (a graph of back-to-back calls on 32 distinct weights, as in a decode
step), the bytes it must move (weight + x + out), GB/s and the
fraction of the device-to-device copy bandwidth measured in the same run. Then a simulated
decode step's GEMMs (32 layers of distinct weights, qkv/o/gate_up/down, + lm_head, T=1, one
CUDA graph): all cuBLAS vs the fastest tactic per site, in us per layer and projected tok/s.
Then the same for the FP8 GEMM plugin (`fp8_gemm`: cuBLASLt vs the FP8 GEMV tactics) at T=1
on the four layer sites and an FP8 lm_head, x already quantized (`--fp8-only`: this part alone): flushed per-call times, and a decode step's
32 layers of FP8 GEMMs in one graph, cuBLASLt vs the fastest tactic per site.

    python3 scripts/bench_gemv.py --out bench_gemv.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
from bench_kernels import replay_ms

from ingot.plugins.gemm import cuda as gemm
from ingot.plugins.quant import cuda_fp8
from ingot.plugins.tactics import time_tactics

DEV, BF16 = "cuda", torch.bfloat16
SITES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYER_SITES = ("qkv", "o", "gate_up", "down")
LAYERS = 32
OTHER_US_PER_LAYER = 20.0  # attention + norms + rope + swiglu (teammate's measurement)


def fixed(args: tuple, kwargs: dict):
    """make_inputs for time_tactics: always the same (already built) inputs."""
    return lambda: (args, kwargs)


def measure_copy_bw() -> float:
    a = torch.randn(2 * 1024**3 // 2, dtype=BF16, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 5)
    del a, b
    return 2 * 2 * 1024**3 / (statistics.median(times) * 1e-3)


def graph_ms(fn, replays: int = 20) -> float:
    """Median ms of one replay of a graph of fn()."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    return replay_ms(g, replays)


def decode_step(choice: dict[str, object], x_in: dict, outs: dict, layers: list, lm_w):
    fns = {site: gemm.make_linear(choice[site]) for site in SITES}

    def step():
        for lw in layers:
            for site in LAYER_SITES:
                fns[site](x_in[site], lw[site], None, out=outs[site])
        fns["lm_head"](x_in["lm_head"], lm_w, None, out=outs["lm_head"])

    return step


def fp8_section(bw: float, reps: int) -> dict:
    """FP8 W8A8 at T=1: every fp8_gemm tactic per layer site (flushed), then 32 layers of FP8
    GEMMs back to back in one graph with cuBLASLt's tactic vs the fastest per site."""
    f8, f32 = torch.float8_e4m3fn, dict(dtype=torch.float32, device=DEV)
    scales = (torch.tensor(0.02, **f32), torch.tensor(0.01, **f32))
    rows, best = [], {}
    for site in (*LAYER_SITES, "lm_head"):
        n, k = SITES[site]
        w = (torch.randn(n, k, device=DEV) * 0.1).to(f8)
        x = (torch.randn(1, k, device=DEV) * 0.1).to(f8)
        inputs = fixed((x, w, *scales, None), {"out_dtype": BF16})
        res = time_tactics("fp8_gemm", cuda_fp8.FP8_GEMM_TACTICS, inputs, reps,
                           cuda_fp8.make_fp8_linear)  # fmt: skip
        nbytes = n * k + k + 2 * n
        for t, ms in res:
            frac = nbytes / (ms * 1e-3) / bw if math.isfinite(ms) and ms > 0 else None
            rows.append({"site": site, "T": 1, "tactic": t.name, "us": ms * 1e3, "frac_bw": frac})
        best[site] = res[0][0]
        print(f"fp8 {site:8s} best {res[0][0].name:24s} {res[0][1] * 1e3:7.1f} us "
              f"({nbytes / (res[0][1] * 1e-3) / bw * 100:5.1f}% of copy bw)")  # fmt: skip
        del w
    layers = [
        {s: (torch.randn(*SITES[s], device=DEV) * 0.1).to(f8) for s in LAYER_SITES}
        for _ in range(LAYERS)
    ]
    x_in = {s: (torch.randn(1, SITES[s][1], device=DEV) * 0.1).to(f8) for s in LAYER_SITES}
    wbytes = sum(t.numel() for lw in layers for t in lw.values())
    default = cuda_fp8.FP8_GEMM_TACTICS[0]
    step = {}
    for label, choice in (("cublaslt", dict.fromkeys(LAYER_SITES, default)), ("tuned", best)):
        fns = {s: cuda_fp8.make_fp8_linear(choice[s]) for s in LAYER_SITES}

        def run(fns=fns):
            for lw in layers:
                for s in LAYER_SITES:
                    fns[s](x_in[s], lw[s], *scales, None, out_dtype=BF16)

        ms = graph_ms(run)
        step[label] = {"ms_layer_gemms": ms, "frac_bw": wbytes / (ms * 1e-3) / bw,
                       "tactics": {s: choice[s].name for s in LAYER_SITES}}  # fmt: skip
        print(f"fp8 decode layer GEMMs ({label}): {ms * 1e3:8.1f} us/token "
              f"({wbytes / (ms * 1e-3) / bw * 100:5.1f}% of copy bw)")  # fmt: skip
    return {"rows": rows, "decode_layers": step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_gemv.json")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--ts", default="1,4,8")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--fp8-only", action="store_true", help="only the FP8 section")
    args = ap.parse_args()
    if args.fp8_only:
        bw = measure_copy_bw()
        result = {"copy_bw_Bps": bw, "device": torch.cuda.get_device_name()}
        result["fp8"] = fp8_section(bw, args.reps)
        write(args.out, result)
        return
    torch.manual_seed(0)
    ts = [int(t) for t in args.ts.split(",")]
    bw = measure_copy_bw()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s ({torch.cuda.get_device_name()})")
    rows, best = [], {}
    factory = gemm.make_linear
    for site, (n, k) in SITES.items():
        w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
        for T in ts:
            x = torch.randn(T, k, device=DEV, dtype=BF16)
            out = torch.empty(T, n, device=DEV, dtype=BF16)
            inputs = fixed((x, w, None), {"out": out})
            res = time_tactics("gemm", gemm.GEMM_TACTICS, inputs, args.reps, factory)
            nbytes = (n * k + T * (n + k)) * 2
            cub = next(ms for t, ms in res if t.name == "cublas")
            for t, ms in res:
                row = {"site": site, "T": T, "N": n, "K": k, "tactic": t.name, "us": ms * 1e3}
                if math.isfinite(ms) and ms > 0:
                    row["GBps"] = nbytes / (ms * 1e-3) / 1e9
                    row["frac_bw"] = nbytes / (ms * 1e-3) / bw
                rows.append(row)
            tb, ms = res[0]
            best[(site, T)] = tb
            print(
                f"{site:8s} T={T} N={n:6d} K={k:5d}  best {tb.name:24s} {ms * 1e3:7.1f} us "
                f"{nbytes / (ms * 1e-3) / bw * 100:5.1f}% | cublas {cub * 1e3:7.1f} us "
                f"{nbytes / (cub * 1e-3) / bw * 100:5.1f}%"
            )
        del w
        torch.cuda.empty_cache()
        if 1 in ts:  # steady state: back-to-back calls on distinct weights, as in a decode step
            copies = 4 if site == "lm_head" else LAYERS
            ws = [torch.randn(n, k, device=DEV, dtype=BF16) * 0.02 for _ in range(copies)]
            x = torch.randn(1, k, device=DEV, dtype=BF16)
            out = torch.empty(1, n, device=DEV, dtype=BF16)
            iso = [r for r in rows if r["site"] == site and r["T"] == 1]
            names = ["cublas"] + [r["tactic"] for r in iso if r["tactic"] != "cublas"][:3]
            line = []
            for name in names:
                fn = factory(next(t for t in gemm.GEMM_TACTICS if t.name == name))
                ms = graph_ms(
                    lambda fn=fn, x=x, o=out, ws=ws: [fn(x, wi, None, out=o) for wi in ws]
                )
                ms /= copies
                nbytes = (n * k + n + k) * 2
                frac = nbytes / (ms * 1e-3) / bw
                rows.append(
                    {
                        "site": site,
                        "T": 1,
                        "N": n,
                        "K": k,
                        "tactic": name,
                        "mode": "sequence",
                        "us": ms * 1e3,
                        "GBps": nbytes / (ms * 1e-3) / 1e9,
                        "frac_bw": frac,
                    }
                )
                line.append(f"{name} {ms * 1e3:.1f} us {frac * 100:.1f}%")
            print(f"  {site} T=1 back-to-back x{copies}: " + " | ".join(line))
            del ws
            torch.cuda.empty_cache()
    result = {"copy_bw_Bps": bw, "device": torch.cuda.get_device_name(), "rows": rows}

    if not args.no_decode:
        layers = [
            {s: torch.randn(*SITES[s], device=DEV, dtype=BF16) * 0.02 for s in LAYER_SITES}
            for _ in range(LAYERS)
        ]
        lm_w = torch.randn(*SITES["lm_head"], device=DEV, dtype=BF16) * 0.02
        x_in = {s: torch.randn(1, SITES[s][1], device=DEV, dtype=BF16) for s in SITES}
        outs = {s: torch.empty(1, SITES[s][0], device=DEV, dtype=BF16) for s in SITES}
        wbytes = sum(t.numel() * 2 for lw in layers for t in lw.values()) + lm_w.numel() * 2
        by_name = {t.name: t for t in gemm.GEMM_TACTICS}
        cublas = {s: by_name["cublas"] for s in SITES}
        choices = [("cublas", cublas)]
        if 1 in ts:  # as the builder picks (isolated, flushed), and by back-to-back time
            choices.append(("tuned", {s: best[(s, 1)] for s in SITES}))
            seq = {}
            for s in SITES:
                cand = [r for r in rows if r["site"] == s and r.get("mode") == "sequence"]
                seq[s] = by_name[min(cand, key=lambda r: r["us"])["tactic"]]
            choices.append(("seqbest", seq))
        dec = {}
        for label, choice in choices:
            ms = graph_ms(decode_step(choice, x_in, outs, layers, lm_w))
            tok = 1e3 / (ms + LAYERS * OTHER_US_PER_LAYER * 1e-3)
            dec[label] = {
                "ms_gemms": ms,
                "frac_bw": wbytes / (ms * 1e-3) / bw,
                "projected_tok_s": tok,
                "tactics": {s: t.name for s, t in choice.items()},
            }
            print(
                f"decode GEMMs ({label:6s}): {ms * 1e3:8.1f} us/token "
                f"({wbytes / (ms * 1e-3) / bw * 100:5.1f}% of copy bw), "
                f"+{OTHER_US_PER_LAYER:.0f} us/layer other -> {tok:6.1f} tok/s"
            )
        result["decode"] = dec
        result["roofline_tok_s"] = bw / wbytes
    write(args.out, result)
    if not args.no_fp8 and torch.cuda.get_device_capability() >= (8, 9):
        result["fp8"] = fp8_section(bw, args.reps)
        write(args.out, result)


def write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
