"""Prefill attention of one 2,048-token prompt (the TTFT-at-2,048 workload) on the engine's
block size, every prefill tactic plus wider candidates, L2 flushed (`plugins.tactics`); and
the batch-1 decode tactics at a 256-key context; on an FP8 cache (V transposed, as FP8 pools
store it) every prefill tactic with and without `fp8_queries` (Q.K on FP8 tensor cores). µs
and TFLOP/s per tactic, JSON. With
BLOCK_SIZES="32 64 128" in the environment, the same at each KV block size (key tiles that fit
in one block read it whole: what larger blocks would buy the wide tiles). "short_prompts": 64
prompts of 128 tokens on the FP8 cache, as a 128/128 mixed step's prefill launch runs them
(every tactic, and the short-prompt candidates); `--short-only` times just that.

    python3 scripts/bench_prefill_attention.py --out bench_prefill_attention.json
"""

from __future__ import annotations

import functools
import json
import math
import os

import torch
from bench_kernels import HD, HQ, bench_cli, fixed, paged

from ingot.plugins.attention import triton_decode as dec
from ingot.plugins.attention import triton_prefill as pf
from ingot.plugins.attention.layout import to_v_layout
from ingot.plugins.tactics import time_tactics

BS = 32  # timed when BLOCK_SIZES is unset (the FP8 bench engines'; the BF16 preset's is 64)


tactic = pf.prefill_tactic

EXTRA = (
    tactic(128, 128, 8, 3),
    tactic(128, 64, 4, 3),
    tactic(128, 32, 4, 3),
    tactic(64, 128, 4, 2),
)


def main() -> None:
    args, bw = bench_cli(__doc__, "bench_prefill_attention.json", 20,
                         (("--short-only", "time the short prompts only"),))  # fmt: skip
    out = {"copy_bandwidth_bytes_s": bw, "tokens_per_block": BS}
    out["short_prompts"] = short_prompts(BS, args.reps, bw)
    if args.short_only:
        args.out.write_text(json.dumps(out, indent=2))
        return
    for bs in [int(b) for b in os.environ.get("BLOCK_SIZES", str(BS)).split()]:
        key = "" if bs == BS else f"_bs{bs}"
        out["prefill_2048" + key], out["decode_b1_ctx256" + key] = at_block_size(bs, args.reps)
        out["prefill_2048_fp8" + key] = fp8_prefill(bs, args.reps)
    args.out.write_text(json.dumps(out, indent=2))


def at_block_size(bs: int, reps: int) -> tuple[dict, dict]:
    """Prefill (2,048 tokens) and batch-1 decode (256 keys) tactic times on bs-token blocks."""
    scale = 1 / math.sqrt(HD)
    n, prefill = 2048, {}
    q, kc, vc, bt, cl, qsl = paged([n], [n], bs=bs)
    flops = 4 * HD * HQ * n * (n + 1) / 2
    cands = pf.PREFILL_TACTICS + EXTRA
    res = time_tactics(
        "paged_attention", cands, fixed((q, kc, vc, bt, cl, qsl, scale), {"max_query_len": n}),
        reps, factory=pf.make_prefill_attention,
    )  # fmt: skip
    for t, ms in res:
        prefill[t.name] = {"us": round(ms * 1e3, 1), "TFLOPs": flops / ms / 1e9}
        print(
            f"bs {bs} prefill 2048 {t.name:22s} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s"
        )
    q, kc, vc, bt, cl, qsl = paged([256], [1], bs=bs)
    res = time_tactics(
        "paged_attention", dec.DECODE_TACTICS,
        fixed((q, kc, vc, bt, cl, qsl, scale), {"max_context_len": 4096}), reps,
        factory=dec.make_decode_attention,
    )  # fmt: skip
    for t, ms in res[:4]:
        print(f"bs {bs} decode b1 ctx256 {t.name:30s} {ms * 1e3:6.2f} us")
    return prefill, {t.name: round(ms * 1e3, 2) for t, ms in res}


def fp8_prefill(bs: int, reps: int) -> dict:
    """Prefill (2,048 tokens) on an FP8 cache: each tactic as engines run it (K and V converted
    to fp16 for both dots) and with fp8_queries."""
    scale, n, out = 1 / math.sqrt(HD), 2048, {}
    q, kc, vc, bt, cl, qsl = paged([n], [n], bs=bs)
    kc8, vc8, sc = fp8_cache(kc, vc, max_query_len=n)
    flops = 4 * HD * HQ * n * (n + 1) / 2
    for tag, f8q in (("", False), ("+fp8_queries", True)):
        res = time_tactics(
            "paged_attention", pf.PREFILL_TACTICS + EXTRA,
            fixed((q, kc8, vc8, bt, cl, qsl, scale), sc), reps,
            factory=lambda t, f8q=f8q: functools.partial(
                pf.make_prefill_attention(t), fp8_queries=f8q),
        )  # fmt: skip
        for t, ms in res:
            out[t.name + tag] = {"us": round(ms * 1e3, 1), "TFLOPs": flops / ms / 1e9}
        for t, ms in res[:3]:
            print(f"bs {bs} fp8 prefill 2048 {t.name + tag:34s} {ms * 1e3:8.1f} us "
                  f"{flops / ms / 1e9:6.0f} TFLOP/s")  # fmt: skip
    return out


def fp8_cache(kc, vc, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """kc, vc in an FP8 pool (x30, scales 1/30; V transposed, as FP8 pools store it)."""
    dev = kc.device
    sc = {"k_scale": torch.tensor(1 / 30, device=dev), "v_scale": torch.tensor(1 / 30, device=dev)}
    kc8 = (kc * 30).to(torch.float8_e4m3fn)
    return kc8, to_v_layout((vc * 30).to(torch.float8_e4m3fn)), sc | kw


def short_prompts(bs: int, reps: int, bw: float) -> dict:
    """The build's short-prompt batch (SHORT_PROMPT_BATCH) on an FP8 cache: each tactic's µs, TFLOP/s and
    the fraction of the copy bandwidth its bytes (bf16 q and output, FP8 K/V) would take."""
    scale, (b, n) = 1 / math.sqrt(HD), pf.SHORT_PROMPT_BATCH
    q, kc, vc, bt, cl, qsl = paged([n] * b, [n] * b, bs=bs)
    kc8, vc8, kw = fp8_cache(kc, vc, max_query_len=n)
    flops = b * 4 * HD * HQ * n * (n + 1) / 2
    nbytes = 2 * q.numel() * q.element_size() + kc8.numel() + vc8.numel()
    res = time_tactics(
        "paged_attention", pf.PREFILL_TACTICS + EXTRA + pf.SHORT_PROMPT_TACTICS,
        fixed((q, kc8, vc8, bt, cl, qsl, scale), kw), reps, factory=pf.make_prefill_attention,
    )  # fmt: skip
    out = {"floor_us": nbytes / bw * 1e6}
    for t, ms in res:
        out[t.name] = {"us": round(ms * 1e3, 1), "TFLOPs": flops / ms / 1e9,
                       "frac_bw": nbytes / (ms * 1e-3) / bw}  # fmt: skip
    for t, ms in res[:6]:
        print(f"fp8 prefill {b} x {n} {t.name:22s} {ms * 1e3:8.1f} us "
              f"(bytes at copy bw: {out['floor_us']:.1f} us)")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
