"""The large-batch FP8 decode tactics with their cache widened by bit moves (fp8_bits: K, V or
both) against the converting kernel, at 128/128's decode step (512 x 192 keys in 512 rows) and
two long-context points, each tactic's time and whether its output bits equal its converting
twin's. An experiment: the fp8_bits tactics are not in the engines' candidate list until they
win here.

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
from bench_kernels import DEV, HD, HKV, bench_cli, fixed, record  # noqa: E402

from ingot.plugins.attention import triton_decode as dec  # noqa: E402
from ingot.plugins.tactics import time_tactics  # noqa: E402

POINTS = ((512, 192), (128, 2112), (128, 3072))
# each tactic's converting twin (itself for the converting ones)
TWIN = {t.name: base.name for base in dec.LARGE_BATCH_TACTICS
        for t in (base, *(dec.fp8_bits_tactic(base, b) for b in (1, 2, 3)))}  # fmt: skip
TACTICS = tuple(
    t for base in dec.LARGE_BATCH_TACTICS
    for t in (base, *(dec.fp8_bits_tactic(base, b) for b in (1, 2, 3)))
)  # fmt: skip


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
    doc = {"device": torch.cuda.get_device_name(DEV), "copy_bandwidth_Bps": bw, "best": best,
           "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
