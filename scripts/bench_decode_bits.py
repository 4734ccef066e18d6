"""The large-batch FP8 decode tactics with their cache widened by bit moves (fp8_bits: K, V or
both) against the converting kernel, at 128/128's decode step (512 x 192 keys in 512 rows) and
two long-context points, each tactic's time and whether its output bits equal its converting
twin's; and the prefill kernel on one 2,048-token prompt the same way, with fp8_queries too.
An experiment: the fp8_bits tactics are not in the engines' candidate lists until they win
here.

    python3 scripts/bench_decode_bits.py --out decode_bits.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch_decode import fp8_paged  # noqa: E402
from bench_kernels import DEV, HD, HKV, HQ, bench_cli, fixed, record  # noqa: E402

from ingot.plugins.attention import triton_decode as dec  # noqa: E402
from ingot.plugins.attention import triton_prefill as pf  # noqa: E402
from ingot.plugins.tactics import time_tactics  # noqa: E402

POINTS = ((512, 192), (128, 2112), (128, 3072))
# each tactic's converting twin (itself for the converting ones)
TWIN = {t.name: base.name for base in dec.LARGE_BATCH_TACTICS
        for t in (base, *(dec.fp8_bits_tactic(base, b) for b in (1, 2, 3)))}  # fmt: skip
TACTICS = tuple(
    t for base in dec.LARGE_BATCH_TACTICS
    for t in (base, *(dec.fp8_bits_tactic(base, b) for b in (1, 2, 3)))
)  # fmt: skip

# the prefill tactics the FP8 builds picked (m64_n64_w4_s2) and two near it
PREFILL_BASES = tuple(t for t in pf.PREFILL_TACTICS
                      if t.name in ("m64_n64_w4_s2", "m64_n64_w4_s3", "m128_n64_w8_s2"))  # fmt: skip


def prefill(rows: list, bw: float, reps: int) -> dict:
    """One 2,048-token prompt on an FP8 cache: each base tactic and its fp8_bits twins (with
    fp8_queries: V widened only), µs; the twins' output bits against the base's."""
    import functools

    n = 2048
    q, kc, vc, bt, cl, qsl, one = fp8_paged(1, n)
    q = torch.randn(n, HQ, HD, device=DEV, dtype=q.dtype)
    qsl = torch.tensor([0, n], device=DEV, dtype=torch.int32)
    call = (q, kc, vc, bt, cl, qsl, 1 / math.sqrt(HD))
    flops, best = 4 * HD * HQ * n * (n + 1) / 2, {}
    for f8q, bits in ((False, (1, 2, 3)), (True, (2,))):
        tacs = [t for b in PREFILL_BASES for t in (b, *(dec.fp8_bits_tactic(b, x) for x in bits))]
        kw = {"k_scale": one, "v_scale": one, "max_query_len": n, "fp8_queries": f8q}

        def make(t, kw=kw):
            return functools.partial(pf.make_prefill_attention(t), fp8_queries=kw["fp8_queries"])

        t = time_tactics("paged_attention", tacs, fixed(call, {k: v for k, v in kw.items()
                         if k != "fp8_queries"}), reps, factory=make)  # fmt: skip
        tag = "+fp8_queries" if f8q else ""
        record(rows, "prefill_attention_fp8kv" + tag, f"T={n}", t, 0, flops=flops, bw=bw)
        outs = {x.name: make(x)(*call, **{k: v for k, v in kw.items() if k != "fp8_queries"})
                for x in tacs}  # fmt: skip
        for row in rows[-len(t) :]:
            base = row["tactic"].rsplit("_b", 1)[0]
            row["same_bits_as_converting"] = bool(torch.equal(
                outs[row["tactic"]].view(torch.int16), outs[base].view(torch.int16)))  # fmt: skip
        best["prefill" + tag] = {"tactic": t[0][0].name, "us": t[0][1] * 1e3}
        print(f"prefill {n}{tag}: " + ", ".join(f"{x.name} {ms * 1e3:.1f}" for x, ms in t))
    return best


def main() -> None:
    args, bw = bench_cli(__doc__, "decode_bits.json", 20)
    rows, best = [], {}
    for B, ctx in POINTS:
        q, kc, vc, bt, cl, qsl, one = fp8_paged(B, ctx)
        call = (q, kc, vc, bt, cl, qsl, 1 / math.sqrt(HD))
        kw = {"k_scale": one, "v_scale": one}
        t = time_tactics("paged_attention", TACTICS, fixed(call, kw), args.reps,
                         factory=dec.make_decode_attention)  # fmt: skip
        record(rows, "decode_attention_fp8kv", f"B={B} ctx={ctx}", t, B * ctx * HKV * HD * 2, bw=bw)
        outs = {tac.name: dec.make_decode_attention(tac)(*call, **kw) for tac in TACTICS}
        for row in rows[-len(t) :]:
            twin = outs[TWIN[row["tactic"]]]
            row["same_bits_as_converting"] = bool(torch.equal(
                outs[row["tactic"]].view(torch.int16), twin.view(torch.int16)))  # fmt: skip
        best[f"{B}x{ctx}"] = {"tactic": t[0][0].name, "us": t[0][1] * 1e3}
        print(f"B={B} ctx={ctx}: " + ", ".join(f"{tac.name} {ms * 1e3:.1f}" for tac, ms in t[:8]))
    best |= prefill(rows, bw, args.reps)
    doc = {"device": torch.cuda.get_device_name(DEV), "copy_bandwidth_Bps": bw, "best": best,
           "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
