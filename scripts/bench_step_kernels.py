"""The small kernels of an FP8 engine's step at throughput batch sizes, every tactic timed.

At 128 in / 128 out the decode steps run at batch ~500 and the mixed steps at ~8,700 tokens;
there the norms, SwiGLU, RoPE + KV write and activation quantization took ~13% of the GPU time
(docs/bench/profile-fp8-128-128.json). Per kernel and token count: each tactic's median
microseconds (L2 flushed between calls), the bytes it must move and the fraction of the
measured copy bandwidth. Also the logits read-out of a decode step: sampling from the lm_head's
bf16 output against widening it to float32 first (what the engine did until Decoder.step_logits).

    python3 scripts/bench_step_kernels.py --out step_kernels.json      # on the H200, ~30 s
"""

from __future__ import annotations

import functools
import json
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
    VOCAB,
    D,
    bench_cli,
    fixed,
    record,
)

from ingot.plugins.attention.layout import v_like  # noqa: E402
from ingot.plugins.quant import triton_quantize as tq  # noqa: E402
from ingot.plugins.rope import reference as rope_ref  # noqa: E402
from ingot.plugins.rope import triton_kernels as rope  # noqa: E402
from ingot.plugins.tactics import time_tactics  # noqa: E402
from ingot.runtime.sampler import (  # noqa: E402
    _argmax_chunks,
    aligned_argmax_chunks,
    greedy_tokens,
)

F8 = torch.float8_e4m3fn
TOKENS = (512, 8192)
BS = 32  # the throughput engines' tokens_per_block


def bench_quantizing(rows, bw, reps) -> None:
    s = torch.tensor(0.05, device=DEV)
    w = torch.randn(D, device=DEV, dtype=BF16)
    for T in TOKENS:
        x, r = (torch.randn(T, D, device=DEV, dtype=BF16) for _ in range(2))
        t = time_tactics(
            "rms_norm_quant_fp8", tq.QUANTIZE_TACTICS, fixed((x, w, 1e-5, s, r), {}), reps
        )
        # reads x and the residual, writes the new residual (bf16) and the fp8 activations
        record(rows, "add_rms_norm_quant", f"T={T} D={D}", t, T * D * (3 * 2 + 1), bw=bw)
        gu = torch.randn(T, 2 * INTER, device=DEV, dtype=BF16)
        t = time_tactics("swiglu_quant_fp8", tq.QUANTIZE_TACTICS, fixed((gu, s), {}), reps)
        record(rows, "swiglu_quant", f"T={T} I={INTER}", t, T * INTER * (2 * 2 + 1), bw=bw)
        o = torch.randn(T, D, device=DEV, dtype=BF16)
        t = time_tactics(
            "quantize",
            tq.QUANTIZE_TACTICS,
            fixed((o, s), {}),
            reps,
            factory=lambda tac: functools.partial(tq.quantize_fp8, tactic=tac),
        )
        record(rows, "quantize (attn out)", f"T={T} D={D}", t, T * D * (2 + 1), bw=bw)


def bench_rope_fp8_kv(rows, bw, reps) -> None:
    """RoPE + KV write into an FP8 pool (V transposed per block, as the engines store it), and,
    to tell what its cost is, the same into an FP8 pool with V token-major and a BF16 pool.
    Slots: "scattered" (one token per sequence, as a decode step writes: each token lands in
    another block, so its transposed V touches 1,024 sectors a byte each), "runs" (prompts'
    consecutive slots from block starts, at rows that are multiples of 2,048) or "packed runs"
    (a mixed step's rows as the scheduler packs them: a 37-token chunk continuing a prompt
    mid-block, then prompts from block starts, each at a row that is not a multiple of 32). "fp8 v by attention": a decode
    step's write into the engines' FP8 pool now (K only: the attention kernel stores V);
    "fp8 v per token": a prefill's V stored token by token, as before V segments."""
    cos, sin = (
        c.to(DEV)
        for c in rope_ref.cos_sin_cache(rope_ref.inv_freq(HD, 500000.0, "llama3", 8.0), 8192)
    )
    ks, vs = torch.tensor(0.1, device=DEV), torch.tensor(0.1, device=DEV)
    for T, slot_kind in (
        (512, "scattered"),
        (8192, "runs"),
        (8192, "packed runs"),
        (8192, "scattered"),
    ):
        qkv = torch.randn(T, (HQ + 2 * HKV) * HD, device=DEV, dtype=BF16)
        q = qkv[:, : HQ * HD].view(T, HQ, HD)
        k = qkv[:, HQ * HD : (HQ + HKV) * HD].view(T, HKV, HD)
        v = qkv[:, (HQ + HKV) * HD :].view(T, HKV, HD)
        pos = torch.randint(0, 8192, (T,), device=DEV)
        nb = T + 1024
        if slot_kind == "scattered":  # one slot in each of T distinct blocks
            blocks = torch.randperm(nb, device=DEV)[:T]
            slots = (blocks * BS + torch.randint(0, BS, (T,), device=DEV)).int()
        elif slot_kind == "runs":  # runs of 2,048 consecutive slots from block-aligned starts
            starts = torch.randperm(nb // 64, device=DEV)[: T // 2048] * 64 * BS
            slots = (starts[:, None] + torch.arange(2048, device=DEV)).reshape(-1).int()
        else:  # packed: 37 slots from offset 11 of a block, then runs from block starts
            starts = torch.randperm(nb // 64, device=DEV)[: T // 2048 + 1] * 64 * BS
            lens = [37, 2048, 2048, 2048, T - 37 - 3 * 2048]
            slots = torch.cat(
                [starts[i] + (11 if i == 0 else 0) + torch.arange(n, device=DEV)
                 for i, n in enumerate(lens)]
            ).int()  # fmt: skip
        pools = ("fp8", "fp8_v_token_major", "bf16")
        if slot_kind == "scattered" and T == 512:
            pools += ("fp8_v_by_attention",)
        if T >= rope.V_SEGMENT_MIN_TOKENS:  # the engines' pool, V stored token by token
            pools += ("fp8_v_per_token",)
        for pool in pools:
            dtype = BF16 if pool == "bf16" else F8
            kc = torch.zeros(nb, BS, HKV, HD, device=DEV, dtype=dtype)
            # the FP8 engines' layout: V transposed
            vc = v_like(kc, transposed=pool in ("fp8", "fp8_v_by_attention", "fp8_v_per_token"))

            scales = {"k_scale": ks, "v_scale": vs} if dtype == F8 else {}
            if pool == "fp8_v_by_attention":
                scales["v_rows"] = 0
            elif pool != "fp8_v_per_token":  # every token a prompt's: V a segment at a time
                scales["runs"] = T
            t = time_tactics(
                "rope",
                rope.ROPE_TACTICS,
                fixed((q, k, v, pos, cos, sin, kc, vc, slots), scales),
                reps,
                factory=rope.make_rope_write_kv,
            )
            # reads q, k, v and cos/sin rows; writes q and k, v into the pool
            nbytes = T * ((HQ + 2 * HKV) * HD * 2 + HQ * HD * 2 + HD * 8)
            nbytes += T * (1 if pool == "fp8_v_by_attention" else 2) * HKV * HD * dtype.itemsize
            record(rows, f"rope_write_kv {pool}", f"T={T} {slot_kind}", t, nbytes, bw=bw)


def _ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def bench_logits_readout(rows, reps) -> None:
    """argmax of a decode step's logits: widened to float32 first (the old graphs) or not; and
    in bf16 with 16-byte-aligned chunks (sampler.aligned_argmax_chunks) instead of the default
    ones, each as a one-call CUDA graph (GPU time, as the decode graphs run it)."""
    aligned = aligned_argmax_chunks(VOCAB)
    for B in (1, 128, 512):
        logits = torch.randn(B, VOCAB, device=DEV, dtype=BF16)
        old = _ms(lambda lg=logits: greedy_tokens(lg.float()), reps)
        new = _ms(lambda lg=logits: greedy_tokens(lg), reps)
        graphed = {c: _ms(_graphed(lambda lg=logits, c=c: greedy_tokens(lg, c)), reps)
                   for c in (_argmax_chunks(VOCAB), aligned)}  # fmt: skip
        rows.append({"kernel": "logits_argmax", "shape": f"B={B} V={VOCAB}",
                     "float32_then_argmax_us": old * 1e3, "bf16_argmax_us": new * 1e3,
                     "graphed_us_by_chunks": {c: ms * 1e3 for c, ms in graphed.items()}})  # fmt: skip
        print(
            f"logits argmax      B={B:<4d} float32 first {old * 1e3:8.1f} us"
            f"   bf16 {new * 1e3:8.1f} us   graphed by chunks "
            + "  ".join(f"{c}: {ms * 1e3:.1f} us" for c, ms in graphed.items())
        )


def _graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call); returns the replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    args, bw = bench_cli(__doc__, "step_kernels.json", 30)
    rows: list[dict] = []
    bench_quantizing(rows, bw, args.reps)
    bench_rope_fp8_kv(rows, bw, args.reps)
    bench_logits_readout(rows, args.reps)
    args.out.write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
