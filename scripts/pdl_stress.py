"""Hunt the illegal memory access seen now and then with PDL on the H200 (docs/performance.md,
2026-12-04): at tiny-model shapes, where kernels are shortest and overlaps tightest.

A case is one GEMV tactic at one site of the tiny Llama timed as build-engine's tactic timing
does it in a PDL engine (plugins/tactics.py: each call after its predecessor, both with
programmatic dependent launch; `before`), `--reps` times, then a device sync, so a fault is
pinned to its case. A fault poisons the process's CUDA context, so cases run in a child
process and the driver starts a new child after a fault. JSON: cases run and faults.

    python3 scripts/pdl_stress.py --out out/pdl_stress.json [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ingot.runtime.config import BuildConfig, ModelConfig

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    family="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
BUILD = BuildConfig(max_batch_size=8, max_seq_len=256, max_num_tokens=64, tokens_per_block=16)
SITES = {  # site: (N, K, predecessor)
    "qkv": (128, 64, "norm"),
    "o": (64, 64, "attention"),
    "gate_up": (256, 64, "norm"),
    "down": (64, 128, None),
    "lm_head": (512, 64, "norm"),
}


def cases() -> list[tuple[str, int, str, str]]:
    from ingot.plugins.gemm.cuda import GEMM_TACTICS

    gemv = [t.name for t in GEMM_TACTICS if t.as_dict().get("max_m", 0)]
    return [
        (trigger, prefetch, site, tactic)
        for trigger in ("before_wait", "after_wait")
        for prefetch in (256, 0)
        for site in SITES
        for tactic in gemv
    ]


def child(start: int, reps: int) -> None:
    import torch

    from ingot.compiler.tactic_select import _Shapes
    from ingot.plugins import pdl
    from ingot.plugins.attention.triton_decode import DECODE_TACTICS, make_decode_attention
    from ingot.plugins.gemm import cuda as gemm_cuda
    from ingot.plugins.registry import get_spec
    from ingot.plugins.tactics import resolve_factory, time_tactics

    shapes = _Shapes(TINY, BUILD)
    tactics = {t.name: t for t in gemm_cuda.GEMM_TACTICS}
    norm = resolve_factory("add_rms_norm")(get_spec("add_rms_norm").default_tactic("cuda"))
    attention = make_decode_attention(DECODE_TACTICS[0])
    all_cases = cases()
    for i in range(start, len(all_cases)):
        trigger, prefetch, site, tactic = all_cases[i]
        pdl.TRIGGER, gemm_cuda.PREFETCH_BYTES = trigger, prefetch
        n, k, pred = SITES[site]
        before = None
        if pred == "norm":
            nargs, nkw = shapes.op("add_rms_norm")
            before = lambda a=nargs, kw=nkw: norm(*a, **kw)  # noqa: E731
        elif pred == "attention":
            aargs, akw = shapes.attention(1, 200, False)
            before = lambda a=aargs, kw=akw: attention(*a, **kw)  # noqa: E731
        print(f"CASE {i}", flush=True)
        try:
            for _ in range(reps):
                res = time_tactics(
                    "gemm",
                    [tactics[tactic]],
                    lambda n=n, k=k: shapes.gemm(n, k, False),
                    before=before,
                )
                if res[0][1] == float("inf"):
                    raise RuntimeError("the candidate failed (fault swallowed by the timer?)")
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report the case, then die (context poisoned)
            print(f"FAULT {i} {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            sys.exit(3)
        print(f"OK {i} {res[0][1]:.5f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=240.0)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.reps)
        return
    all_cases = cases()
    faults, ok, start, t0 = [], {}, 0, time.perf_counter()
    while start < len(all_cases) and time.perf_counter() - t0 < args.budget_s:
        left = args.budget_s - (time.perf_counter() - t0)
        cmd = [sys.executable, __file__, "--out", str(args.out), "--reps", str(args.reps),
               "--child", str(start)]  # fmt: skip
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 1))
            lines = r.stdout.splitlines()
        except subprocess.TimeoutExpired as e:
            text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            lines = text.splitlines() + ["TIMEOUT"]
        last = start - 1
        for line in lines:
            word, *rest = line.split(" ", 2)
            if word == "OK":
                last = int(rest[0])
                ok[last] = float(rest[1])
            elif word == "FAULT":
                last = int(rest[0])
                faults.append({"case": all_cases[last], "error": rest[1] if len(rest) > 1 else ""})
        if lines and lines[-1] == "TIMEOUT":
            break
        if not any(line.startswith(("OK", "FAULT")) for line in lines):
            faults.append({"case": None, "error": (r.stderr or "")[-2000:]})
            break
        start = last + 1
    out = {
        "cases": len(all_cases),
        "run": len(ok) + len(faults),
        "reps": args.reps,
        "faults": faults,
        "ms": {"|".join(map(str, all_cases[i])): v for i, v in sorted(ok.items())},
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("cases", "run", "faults")}, indent=1))


if __name__ == "__main__":
    main()
