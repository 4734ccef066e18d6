"""Decode attention beside the FP8 GEMMs, decision data for overlapping them in an engine's
large-batch decode steps (the throughput points of the quantization issue).

A decode layer (QKV, attention over an FP8 cache, o, gate_up, down; FP8 GEMMs through cuBLASLt
with fast accumulation) runs LAYERS_TIMED times in one CUDA graph, three ways:

- "serial": the whole batch on one stream, as the engines run it now;
- "halves_serial": two half batches one after the other on one stream (what halving the GEMMs'
  rows costs by itself);
- "halves_two_streams": the two halves on two streams, the second's chain started at its
  attention (one half's memory-bound attention can run while the other's compute-bound GEMMs
  do).

Each also with cuBLASLt told to leave N SMs to other kernels
(`torch._C._set_sm_carveout_experimental`; "gemm_alone" rows say whether it takes effect).

    python3 scripts/bench_overlap.py --out overlap.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch_decode import ENGINE_BS, GRAPH_BOUND, LAYER_GEMMS  # noqa: E402
from bench_kernels import BF16, DEV, HD, bench_cli, fixed, paged, replay_ms  # noqa: E402

from ingot.plugins.attention import triton_decode as dec  # noqa: E402
from ingot.plugins.attention.layout import to_v_layout  # noqa: E402
from ingot.plugins.quant import cuda_fp8  # noqa: E402
from ingot.plugins.tactics import time_tactics  # noqa: E402

F8 = torch.float8_e4m3fn
LAYERS_TIMED = 8
# (batch, context): 128/128's decode steps, 2,048/2,048's middle, 2,048/128's decodes
POINTS = ((512, 192), (448, 3072), (128, 2112))
CARVEOUTS = (0, 8, 16, 32)


class Half:
    """One slice of the batch: its attention inputs and its GEMMs' FP8 inputs."""

    def __init__(self, q, kc, vc, bt, cl, one, attn):
        n = q.shape[0]
        self.n, self.attn = n, attn
        self.args = (q, kc, vc, bt, cl, torch.arange(n + 1, device=DEV, dtype=torch.int32))
        self.kw = {"max_context_len": GRAPH_BOUND, "k_scale": one, "v_scale": one}
        self.x = {name: torch.randn(n, k, device=DEV, dtype=BF16).to(F8)
                  for name, (_, k) in LAYER_GEMMS.items()}  # fmt: skip


def best_attention(half: Half, reps: int):
    t = time_tactics("paged_attention", dec.LARGE_BATCH_TACTICS,
                     fixed((*half.args, 1 / math.sqrt(HD)), half.kw), reps,
                     factory=dec.make_decode_attention)  # fmt: skip
    return t[0]


def layer(half: Half, weights, gemm, order) -> None:
    one = weights["one"]
    for step in order:
        if step == "attn":
            half.attn(*half.args, 1 / math.sqrt(HD), **half.kw)
        else:
            gemm(half.x[step], weights[step], one, one, out_dtype=BF16)


def graph_ms(chains, reps: int) -> float:
    """ms of one replay of a graph holding `chains` (callables), each on its own stream."""
    streams = [torch.cuda.Stream() for _ in chains]
    main = streams[0]
    main.wait_stream(torch.cuda.current_stream())
    for fn in chains:  # warm up (first launches compile / pick algorithms)
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=main):
        for s in streams[1:]:
            s.wait_stream(main)
        for s, fn in zip(streams, chains, strict=True):
            with torch.cuda.stream(s):
                fn()
        for s in streams[1:]:
            main.wait_stream(s)
    return replay_ms(g, reps)


def set_carveout(sms: int) -> None:
    torch._C._set_sm_carveout_experimental(sms or None)


def point(rows, B, ctx, weights, gemm, reps) -> None:
    q, kc, vc, bt, cl, _ = paged([ctx] * B, [1] * B, ENGINE_BS)
    kc, vc = kc.to(F8), to_v_layout(vc.to(F8), transposed=True)
    one = weights["one"]
    n = B // 2
    full = Half(q, kc, vc, bt, cl, one, None)
    halves = [Half(q[s], kc, vc, bt[s], cl[s], one, None) for s in (slice(0, n), slice(n, B))]
    for h in (full, *halves):
        tactic, ms = best_attention(h, reps)
        h.attn = dec.make_decode_attention(tactic)
        print(f"B={B} ctx={ctx}: {h.n} rows' attention {tactic.name} {ms * 1e3:.1f} us")
        rows.append({"kernel": "attention_alone", "shape": f"B={h.n} ctx={ctx}",
                     "tactic": tactic.name, "us": ms * 1e3})  # fmt: skip
    plain = ("qkv", "attn", "o", "gate_up", "down")
    rotated = ("attn", "o", "gate_up", "down", "qkv")

    def chain(h, order):
        return lambda: [layer(h, weights, gemm, order) for _ in range(LAYERS_TIMED)]

    variants = {
        "serial": [chain(full, plain)],
        "halves_serial": [lambda: [chain(h, plain)() for h in halves]],
        "halves_two_streams": [chain(halves[0], plain), chain(halves[1], rotated)],
    }
    base = None
    for sms in CARVEOUTS:
        set_carveout(sms)
        for name, chains in variants.items():
            if name != "halves_two_streams" and sms:
                continue  # one stream: the carveout only slows its GEMMs
            us = graph_ms(chains, reps) / LAYERS_TIMED * 1e3
            base = us if name == "serial" else base
            rows.append({"kernel": name, "shape": f"B={B} ctx={ctx}", "carveout_sms": sms,
                         "us_per_layer": us, "vs_serial": base / us})  # fmt: skip
            print(f"B={B} ctx={ctx} {name:20s} carveout {sms:2d}: {us:8.1f} us/layer "
                  f"(x{base / us:.3f} of serial)")  # fmt: skip
    set_carveout(0)


def gemm_alone(rows, weights, gemm, reps) -> None:
    """gate_up at 512 rows with each carveout: whether cuBLASLt takes it."""
    x = torch.randn(512, LAYER_GEMMS["gate_up"][1], device=DEV, dtype=BF16).to(F8)
    one = weights["one"]
    for sms in CARVEOUTS:
        set_carveout(sms)
        fn = lambda: [gemm(x, weights["gate_up"], one, one, out_dtype=BF16) for _ in range(10)]  # noqa: E731
        us = graph_ms([fn], reps) / 10 * 1e3
        rows.append({"kernel": "gemm_alone", "shape": "gate_up M=512", "carveout_sms": sms,
                     "us": us})  # fmt: skip
        print(f"gate_up M=512 carveout {sms:2d}: {us:.1f} us")
    set_carveout(0)


def main() -> None:
    args, bw = bench_cli(__doc__, "overlap.json", 20)
    weights = {name: torch.randn(nk, device=DEV, dtype=BF16).to(F8)
               for name, nk in LAYER_GEMMS.items()}  # fmt: skip
    weights["one"] = torch.ones((), device=DEV, dtype=torch.float32)
    gemm = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(cuda_fp8.FP8_GEMM_TACTICS[0]))
    rows: list[dict] = []
    gemm_alone(rows, weights, gemm, args.reps)
    for B, ctx in POINTS:
        point(rows, B, ctx, weights, gemm, args.reps)
    doc = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw,
           "layers_timed": LAYERS_TIMED, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
