"""Time every GPU kernel's tactics at Llama-3.1-8B shapes; write JSON for the default tactic table.

Per (kernel, shape): each tactic's median ms (L2 flushed between calls, `plugins.tactics`), the
bytes it must move, achieved GB/s and the fraction of the measured copy bandwidth. Then one
whole batch-1 decode step (32 layers + lm_head, the best tactics, CUDA graph replay) as
ms/token and tok/s against the weight-streaming roofline.

    python3 scripts/bench_kernels.py --out bench_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ingot.plugins.activation import triton_kernels as act
from ingot.plugins.attention import triton_decode as dec
from ingot.plugins.attention import triton_kv_write as kvw
from ingot.plugins.attention import triton_prefill as pf
from ingot.plugins.gemm import cuda as gemm
from ingot.plugins.norm import triton_kernels as norm
from ingot.plugins.rope import reference as rope_ref
from ingot.plugins.rope import triton_kernels as rope
from ingot.plugins.tactics import time_tactics

D, HQ, HKV, HD, INTER, VOCAB, LAYERS, BS = 4096, 32, 8, 128, 14336, 128256, 32, 16
DEV, BF16 = "cuda", torch.bfloat16
NOMINAL_BW = 4.2e12


def fixed(args: tuple, kwargs: dict):
    """make_inputs for time_tactics: always the same (already built) inputs."""
    return lambda: (args, kwargs)


def replay_ms(g, replays: int = 20) -> float:
    """Median ms of one replay of CUDA graph g (event-timed, each replay synchronized)."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def measure_copy_bw() -> float:
    a = torch.empty(2 * 1024**3 // 2, dtype=BF16, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 10 / (s.elapsed_time(e) * 1e-3)


def bench_cli(doc: str, out: str, reps: int, flags: tuple[tuple[str, str], ...] = ()
              ) -> tuple[argparse.Namespace, float]:  # fmt: skip
    """A benchmark script's command line (--out, --reps, and on/off `flags`: (name, help)) and
    the measured copy bandwidth."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--reps", type=int, default=reps)
    for flag, text in flags:
        ap.add_argument(flag, action="store_true", help=text)
    args = ap.parse_args()
    bw = measure_copy_bw()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    return args, bw


def paged(ctxs, qlens, bs=BS):
    B = len(ctxs)
    width = max(math.ceil(c / bs) for c in ctxs)
    nb = B * width
    kc = torch.randn(nb, bs, HKV, HD, device=DEV, dtype=BF16)
    vc = torch.randn(nb, bs, HKV, HD, device=DEV, dtype=BF16)
    bt = torch.randperm(nb, device=DEV).int().view(B, width)
    q = torch.randn(sum(qlens), HQ, HD, device=DEV, dtype=BF16)
    qsl = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    qsl[1:] = torch.tensor(qlens, device=DEV).cumsum(0)
    cl = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
    return q, kc, vc, bt, cl, qsl


def record(rows, kernel, shape, timings, nbytes, flops=0.0, bw=NOMINAL_BW):
    for tactic, ms in timings:
        row = {"kernel": kernel, "shape": shape, "tactic": tactic.name, "ms": ms, "bytes": nbytes}
        if math.isfinite(ms):
            row["GBps"] = nbytes / (ms * 1e-3) / 1e9
            row["frac_bw"] = nbytes / (ms * 1e-3) / bw
            if flops:
                row["TFLOPs"] = flops / (ms * 1e-3) / 1e12
        rows.append(row)
    best = timings[0]
    print(
        f"{kernel:18s} {shape:34s} best {best[0].name:28s} {best[1] * 1e3:9.1f} us "
        f"{nbytes / (best[1] * 1e-3) / bw * 100 if math.isfinite(best[1]) else 0:6.1f}% bw"
    )
    return best[0]


def bench_ops(rows, bw, reps):
    best = {}
    w = torch.randn(D, device=DEV, dtype=BF16)
    for T in (1, 16, 2048):
        x, r = (torch.randn(T, D, device=DEV, dtype=BF16) for _ in range(2))
        t = time_tactics("add_rms_norm", norm.RMS_NORM_TACTICS, fixed((x, r, w, 1e-5), {}), reps)
        best[("add_rms_norm", T)] = record(
            rows, "add_rms_norm", f"T={T} D={D}", t, 4 * T * D * 2 + 2 * D, bw=bw
        )
        t = time_tactics("rms_norm", norm.RMS_NORM_TACTICS, fixed((x, w, 1e-5), {}), reps)
        best[("rms_norm", T)] = record(
            rows, "rms_norm", f"T={T} D={D}", t, 2 * T * D * 2 + 2 * D, bw=bw
        )
    cos, sin = (
        c.to(DEV)
        for c in rope_ref.cos_sin_cache(rope_ref.inv_freq(HD, 500000.0, "llama3", 8.0), 131072)
    )
    for T in (1, 16, 2048):
        qkv = torch.randn(T, (HQ + 2 * HKV) * HD, device=DEV, dtype=BF16)
        q, k, v = (
            qkv[:, : HQ * HD].view(T, HQ, HD),
            qkv[:, HQ * HD : (HQ + HKV) * HD].view(T, HKV, HD),
            qkv[:, (HQ + HKV) * HD :].view(T, HKV, HD),
        )
        pos = torch.randint(0, 131072, (T,), device=DEV)
        nb = T // BS + 1024
        kc, vc = (torch.randn(nb, BS, HKV, HD, device=DEV, dtype=BF16) for _ in range(2))
        slots = torch.randperm(nb * BS, device=DEV)[:T].int()
        t = time_tactics("rope", rope.ROPE_TACTICS, fixed((q, k, pos, cos, sin), {}), reps)
        best[("rope", T)] = record(
            rows, "rope", f"T={T}", t, 2 * T * (HQ + HKV) * HD * 2 + T * HD * 8, bw=bw
        )
        t = time_tactics(
            "rope",
            rope.ROPE_TACTICS,
            fixed((q, k, v, pos, cos, sin, kc, vc, slots), {}),
            reps,
            factory=rope.make_rope_write_kv,
        )
        best[("rope_write_kv", T)] = record(
            rows, "rope_write_kv", f"T={T}", t, T * (2 * HQ + 4 * HKV) * HD * 2 + T * HD * 8, bw=bw
        )
        t = time_tactics(
            "kv_cache_write", kvw.KV_WRITE_TACTICS, fixed((k, v, kc, vc, slots), {}), reps
        )
        best[("kv_write", T)] = record(
            rows, "kv_cache_write", f"T={T}", t, 4 * T * HKV * HD * 2, bw=bw
        )
    for T in (1, 16, 2048):
        gu = torch.randn(T, 2 * INTER, device=DEV, dtype=BF16)
        t = time_tactics("swiglu", act.SWIGLU_TACTICS, fixed((gu,), {}), reps)
        best[("swiglu", T)] = record(
            rows, "swiglu", f"T={T} I={INTER}", t, 3 * T * INTER * 2, bw=bw
        )
    for name, n, k in (
        ("qkv", 6144, D),
        ("o", D, D),
        ("gate_up", 2 * INTER, D),
        ("down", D, INTER),
        ("lm_head", VOCAB, D),
    ):
        wt = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
        for T in (1, 16, 2048):
            x = torch.randn(T, k, device=DEV, dtype=BF16)
            t = time_tactics("gemm", gemm.GEMM_TACTICS, fixed((x, wt), {}), reps)
            best[("gemm_" + name, T)] = record(
                rows,
                "gemm",
                f"{name} T={T} N={n} K={k}",
                t,
                (n * k + T * (n + k)) * 2,
                2.0 * T * n * k,
                bw=bw,
            )
        del wt
    return best


def bench_attention(rows, bw, reps):
    best = {}
    scale = 1 / math.sqrt(HD)
    for B, ctx in ((1, 2048), (1, 8192), (1, 32768), (8, 2048), (64, 1024)):
        q, kc, vc, bt, cl, qsl = paged([ctx] * B, [1] * B)
        t = time_tactics(
            "paged_attention",
            dec.DECODE_TACTICS,
            fixed((q, kc, vc, bt, cl, qsl, scale), {"max_context_len": ctx}),
            reps,
            factory=dec.make_decode_attention,
        )
        best[("decode", B, ctx)] = record(
            rows, "decode_attention", f"B={B} ctx={ctx}", t, B * ctx * HKV * HD * 2 * 2, bw=bw
        )
    for ctxs, qlens in (([2048], [2048]), ([4096], [512]), ([512] * 8, [512] * 8)):
        q, kc, vc, bt, cl, qsl = paged(ctxs, qlens)
        flops = sum(
            4 * HD * HQ * sum(c - n + i + 1 for i in range(n))
            for c, n in zip(ctxs, qlens, strict=True)
        )
        t = time_tactics(
            "paged_attention",
            pf.PREFILL_TACTICS,
            fixed((q, kc, vc, bt, cl, qsl, scale), {"max_query_len": max(qlens)}),
            reps,
            factory=pf.make_prefill_attention,
        )
        nbytes = sum(c for c in ctxs) * HKV * HD * 4 + 2 * q.numel() * 2
        best[("prefill", str(qlens))] = record(
            rows,
            "prefill_attention",
            f"ctx={ctxs[0]}x{len(ctxs)} q={qlens[0]}",
            t,
            nbytes,
            flops,
            bw=bw,
        )
    return best


def bench_decode_step(best, bw, ctx=2048, cublas_only=False):
    """One batch-1 decode step of Llama-3.1-8B (random weights), captured as a CUDA graph."""
    mk = lambda *s: torch.randn(*s, device=DEV, dtype=BF16) * 0.02  # noqa: E731
    layers = [
        dict(
            qkv=mk(6144, D),
            o=mk(D, D),
            gu=mk(2 * INTER, D),
            down=mk(D, INTER),
            n1=mk(D) + 1,
            n2=mk(D) + 1,
        )
        for _ in range(LAYERS)
    ]
    lm_head, final_n = mk(VOCAB, D), mk(D) + 1
    nblk = ctx // BS + 1
    kcs = [torch.randn(nblk, BS, HKV, HD, device=DEV, dtype=BF16) for _ in range(LAYERS)]
    vcs = [torch.randn(nblk, BS, HKV, HD, device=DEV, dtype=BF16) for _ in range(LAYERS)]
    bt = torch.arange(nblk, device=DEV, dtype=torch.int32)[None]
    cl = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    pos = torch.tensor([ctx - 1], device=DEV)
    slots = torch.tensor([ctx - 1], dtype=torch.int32, device=DEV)
    cos, sin = (
        c.to(DEV)
        for c in rope_ref.cos_sin_cache(rope_ref.inv_freq(HD, 500000.0, "llama3", 8.0), 8192)
    )
    add_norm = norm.make_add_rms_norm(best[("add_rms_norm", 1)])
    rms = norm.make_rms_norm(best[("rms_norm", 1)])
    rope_kv = rope.make_rope_write_kv(best[("rope_write_kv", 1)])
    attn = dec.make_paged_attention(
        dec.combine_tactics(best[("decode", 1, 2048)], pf.PREFILL_TACTICS[0])
    )
    swiglu = act.make_swiglu(best[("swiglu", 1)])
    lin = {
        n: gemm.make_linear(None if cublas_only else best[("gemm_" + n, 1)])
        for n in ("qkv", "o", "gate_up", "down", "lm_head")
    }
    h = torch.randn(1, D, device=DEV, dtype=BF16)
    res = torch.zeros(1, D, device=DEV, dtype=BF16)

    def step():
        x, r = h, res
        for i, L in enumerate(layers):
            xn, r = add_norm(x, r, L["n1"], 1e-5)
            qkv = lin["qkv"](xn, L["qkv"])
            q = qkv[:, : HQ * HD].view(1, HQ, HD)
            k = qkv[:, HQ * HD : (HQ + HKV) * HD].view(1, HKV, HD)
            v = qkv[:, (HQ + HKV) * HD :].view(1, HKV, HD)
            q = rope_kv(q, k, v, pos, cos, sin, kcs[i], vcs[i], slots)
            a = attn(
                q,
                kcs[i],
                vcs[i],
                bt,
                cl,
                qsl,
                1 / math.sqrt(HD),
                max_query_len=1,
                max_context_len=nblk * BS,
            )
            x = lin["o"](a.view(1, D), L["o"])
            xn, r = add_norm(x, r, L["n2"], 1e-5)
            x = lin["down"](swiglu(lin["gate_up"](xn, L["gu"])), L["down"])
        xn, _ = add_norm(x, r, final_n, 1e-5)
        return lin["lm_head"](xn, lm_head)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ms = replay_ms(g)
    wbytes = sum(t.numel() * 2 for L in layers for t in L.values()) + lm_head.numel() * 2
    kvbytes = LAYERS * ctx * HKV * HD * 4
    del rms
    return {
        "ctx": ctx,
        "ms_per_token": ms,
        "tok_per_s": 1e3 / ms,
        "bytes_per_step": wbytes + kvbytes,
        "roofline_tok_per_s": bw / (wbytes + kvbytes),
        "frac_roofline": (wbytes + kvbytes) / (ms * 1e-3) / bw,
        "kernels_per_step": LAYERS * 9 + 2,
    }


def main() -> None:
    t0 = time.time()
    args, bw = bench_cli(__doc__, "bench_kernels.json", 30)
    rows: list[dict] = []
    best = bench_ops(rows, bw, args.reps)
    best.update(bench_attention(rows, bw, args.reps))
    step_cublas = bench_decode_step(best, bw, cublas_only=True)
    print(f"decode step, cuBLAS GEMMs: {step_cublas['tok_per_s']:.1f} tok/s")
    torch.cuda.empty_cache()
    step = bench_decode_step(best, bw)
    step["cublas_only_tok_per_s"] = step_cublas["tok_per_s"]
    print(
        f"decode step B=1 ctx=2048: {step['ms_per_token']:.3f} ms/token = {step['tok_per_s']:.1f} "
        f"tok/s (roofline {step['roofline_tok_per_s']:.1f}, {step['frac_roofline'] * 100:.1f}%)"
    )
    table = {}
    for key, tac in best.items():
        table.setdefault(key[0], {})["/".join(str(k) for k in key[1:])] = tac.name
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bw_Bps": bw,
        "nominal_bw_Bps": NOMINAL_BW,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "rows": rows,
        "best_tactics": table,
        "decode_step": step,
        "wall_s": time.time() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
