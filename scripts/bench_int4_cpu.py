"""CPU time of the INT4 AWQ work a convert and a build do on the host, at Llama-3.1-8B shapes:
packing codes into words (export), repacking a checkpoint weight into the engine layout
(build-engine), dequantizing an engine weight (the CPU reference GEMM), and the accuracy
report's INT4 pass per decoder layer (4 windows of 128 tokens; --layers 0 skips it).

Usage: python scripts/bench_int4_cpu.py [--out FILE.json] [--layers N] [--repeat R]
Each figure is the best of R runs, in seconds. Random codes and scales: the work does not
depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ingot.compiler.checkpoint import expected_tensor_shapes
from ingot.compiler.quantize.layout import checkpoint_layout, repack_for_engine
from ingot.compiler.quantize.report import ingot_logits
from ingot.plugins.quant.reference import dequantize_w4, pack_int4
from ingot.runtime.config import ModelConfig, QuantConfig

GATE_UP = (28672, 4096)  # the largest INT4 linear of a Llama-3.1-8B layer
GROUP = 128


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times), 4)


def llama_8b(layers: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", vocab_size=128256,
                       hidden_size=4096, intermediate_size=14336, num_layers=layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=8192)  # fmt: skip


def int4_tensors(cfg: ModelConfig, quant: QuantConfig, g: torch.Generator) -> dict:
    """Random checkpoint tensors of an INT4 AWQ checkpoint of `cfg`."""
    t = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
         for n, s in expected_tensor_shapes(cfg).items()}  # fmt: skip
    for n, (shape, st) in checkpoint_layout(cfg, quant).items():
        if st == "I32":
            t[n] = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g)
        else:  # scales (positive) and AWQ's pre_quant_scale
            t[n] = (torch.rand(shape, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=2, help="report pass at 1 and N layers")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    n, k = GATE_UP
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    words = pack_int4(codes)
    scales = (torch.rand(n, k // GROUP, generator=g) * 0.01).to(torch.bfloat16)
    quant = QuantConfig("int4_awq")
    engine_words = repack_for_engine(quant, "layers.0.mlp.gate_up.weight", words)
    out = {
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gate_up_s": {
            "pack_int4": best(lambda: pack_int4(codes), args.repeat),
            "repack_for_engine": best(
                lambda: repack_for_engine(quant, "layers.0.mlp.gate_up.weight", words), args.repeat
            ),
            "dequantize_w4": best(lambda: dequantize_w4(engine_words, scales, GROUP), args.repeat),
        },
    }
    print(json.dumps(out["gate_up_s"]), flush=True)
    if args.layers > 0:
        windows = [torch.randint(0, 128256, (1, 128), generator=g) for _ in range(4)]
        passes = {}
        for layers in sorted({1, args.layers}):
            cfg = llama_8b(layers)
            t = int4_tensors(cfg, quant, g)
            passes[layers] = best(lambda c=cfg, t=t: ingot_logits(c, quant, t, windows), 1)
            print(f"report INT4 pass, {layers} layer(s): {passes[layers]:.1f} s", flush=True)
        out["report_int4_pass_s"] = passes
        if len(passes) == 2:
            out["report_int4_s_per_layer"] = round(
                (passes[args.layers] - passes[1]) / (args.layers - 1), 3
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
