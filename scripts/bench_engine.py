"""End-to-end engine benchmark beside transformers eager, on one workload, in one run.

Makes a Llama-3.1-8B-shaped model with random bf16 weights (nothing downloaded), runs
convert -> build -> load with ingot (timing build and load), then measures batch-1 decode tok/s,
time to first token at 128 and 2,048 prompt tokens, and batch-64 throughput at 128 in / 128 out,
for ingot and for transformers eager `generate` on the same weights. Writes JSON.

    python scripts/bench_engine.py --out out/bench_engine.json            # on the H200
    python scripts/bench_engine.py --tiny --device cpu --out /tmp/b.json  # smoke test anywhere

`--quant fp8` benchmarks an FP8 engine instead (ModelOpt calibration on --device; PDL on, so
`--ab-rounds` compares it with PDL off in one process): on the H200 through
`BENCH_ARGS="--ab-rounds 3 --quant fp8 --skip-hf" bash scripts/device_check.sh bench` (ModelOpt
carried as in `quant`). `fp8_lm_head`: the lm_head in FP8 too (what the issue's FP8 roofline
counts); `int4_awq`, `int4_awq_lm_head`: INT4 AWQ engines (AWQ's search makes the convert
slow: minutes at Llama-8B shapes, keep --calib-size small).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ingot.cli.bench.roofline import decode_weight_bytes, measure_bandwidth
from ingot.plugins.attention.layout import SHORT_CONTEXT

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# seconds the GPU sits idle before each "spaced" TTFT sample (a request reaching an idle server)
PAUSE_S = 0.5
# prompts sent at once for the concurrent time-to-first-token samples
CONCURRENT = (2, 4, 8)
# requests decoding when a prompt joins them (the joining time-to-first-token samples)
JOINING = (4, 32)


def make_model(shape: dict, device: torch.device, out_dir: Path):
    """Random bf16 Llama on `device`, saved as an HF dir with a small offline tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ingot.compiler.examples import make_tokenizer

    cfg = LlamaConfig(**shape, dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # run every request to its full length
    model.save_pretrained(out_dir, max_shard_size="5GB")
    make_tokenizer("llama").save_pretrained(out_dir)
    return model


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def hf_measure(model, device, vocab: int, args) -> dict:
    from transformers import LogitsProcessorList

    from ingot.cli.bench.hf_baseline import StepStamps

    def gen(batch: list[list[int]], new: int, stamps: StepStamps | None = None) -> float:
        ids = torch.tensor(batch, device=device)
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamps] if stamps else []),
            )
        sync(device)
        return time.perf_counter() - t

    gen(prompts(1, 16, vocab, 1), 8)  # warm-up (decode shapes too)
    ttft = {
        n: statistics.median(gen(prompts(1, n, vocab, 10 + i), 1) for i in range(3))
        for n in args.ttft_lens
    }

    def spaced(n: int, i: int) -> float:
        time.sleep(PAUSE_S)  # as ingot's ttft_spaced_samples_ms: the GPU idle first
        return gen(prompts(1, n, vocab, 70 + i), 1)

    ttft_spaced = {n: statistics.median(spaced(n, i) for i in range(3)) for n in args.ttft_lens}
    # decode: time between the first and the last token's logits (as `ingot bench` does)
    stamps = StepStamps(device, time.perf_counter())
    gen(prompts(1, 128, vocab, 20), args.decode_tokens, stamps)
    decode_s = stamps.times[-1] - stamps.times[0]
    tput = gen(prompts(args.batch, args.tput_in, vocab, 30), args.tput_out)
    return {
        "decode_b1_tok_s": (len(stamps.times) - 1) / decode_s,
        "ttft_ms": {str(n): v * 1e3 for n, v in ttft.items()},
        "ttft_spaced_ms": {str(n): v * 1e3 for n, v in ttft_spaced.items()},
        f"throughput_b{args.batch}_out_tok_s": args.batch * args.tput_out / tput,
    }


def kernel_profile(run, top: int = 30, events_out: list | None = None) -> dict:
    """GPU time per kernel name over one call of `run` (torch.profiler), largest first, and
    the timeline: the call's wall time, the span from the first kernel's start to the last
    one's end, the time the GPU sat idle inside it (host-bound stretches, launch gaps between
    a graph's kernels), and the largest idle gaps. events_out: receives the trace's GPU
    events (gpu_events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t) * 1e6
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:120], "calls": e.count, "us": round(us, 1)})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name)).get("traceEvents", [])
    out = {"wall_us": round(wall_us, 1), "gpu_us_total": round(total, 1), "top": rows[:top]}
    if events_out is not None:
        events_out.extend(gpu_events(events))
    return out | timeline(events)


def gpu_events(events: list[dict]) -> list[tuple[float, float, str]]:
    """A chrome trace's GPU events (kernels, copies, memsets) as (start, end, name) in
    microseconds, by start."""
    return sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )


def timeline(events: list[dict], gaps: int = 8) -> dict:
    """Span, idle time and the largest gaps of a chrome trace's GPU events (kernels, copies)."""
    gpu = [(a, b, name[:60]) for a, b, name in gpu_events(events)]
    if not gpu:
        return {}
    idle, end, prev, found = 0.0, gpu[0][1], gpu[0][2], []
    for start, stop, name in gpu[1:]:
        if start > end:
            idle += start - end
            found.append({"us": round(start - end, 1), "after": prev, "before": name})
        if stop > end:
            end, prev = stop, name
    found.sort(key=lambda g: -g["us"])
    return {
        "span_us": round(end - gpu[0][0], 1),
        "idle_us": round(idle, 1),
        "largest_gaps": found[:gaps],
    }


# Batch-1 decode variants the A/B alternates in one process (decode graphs recaptured for
# each; kernels a variant needs that the engine lacks compile at its first capture): the
# engine as built (PDL on: the default); its PDL GEMVs loading one weight chunk before their
# wait instead of up to four; its PDL kernels letting the next one be scheduled after their
# wait instead of before; no PDL; the short-context tier of decode graphs on (off by default:
# runtime/cuda_graphs.py SHORT_TIER); the graphs of every batch bucket captured, as the engine
# loads them (the others capture batch 1's alone: on the H200 the headline runs, on the
# load's graphs, measured ~0.6% below the A/B's `engine`; one pool shared with the larger
# buckets is the suspect). Runs differ by a few % between calls, so a
# change worth less than that is measured here, not across calls. (The norms folded into
# the GEMVs, `--fused-norms`, ran 237-240 tok/s against the engine's 255 in one process on
# 2026-12-05; no longer alternated.)
# --quant: (convert-checkpoint's --quant, --kv-cache-dtype, --quant-lm-head)
QUANT_MODES = {
    "none": ("none", "auto", False),
    "fp8": ("fp8", "fp8", False),
    "fp8_lm_head": ("fp8", "fp8", True),
    "int4_awq": ("int4_awq", "auto", False),
    "int4_awq_lm_head": ("int4_awq", "auto", True),
}

AB_VARIANTS = {
    "engine": {},
    "prefetch_1": {"prefetch_bytes": 0},
    "trigger_after_wait": {"trigger": "after_wait"},
    "no_pdl": {"pdl": False},
    "short_tier": {"short_context": SHORT_CONTEXT},
    "all_buckets": {"all_buckets": True},
}


def decode_ab(ex, decode_b1, args) -> dict[str, list[float]]:
    """decode_b1() (tok/s) of each AB_VARIANTS entry, args.ab_rounds times in turn; the
    executor is left as it was (its decode graphs recaptured for every batch bucket)."""
    from ingot.plugins import pdl
    from ingot.plugins.gemm import cuda as gemm_cuda
    from ingot.runtime import cuda_graphs as cg

    if not args.ab_rounds or ex.graphs is None:
        return {}
    dec, b = ex.decoder, ex.config.build
    saved = {
        "pdl": dec.ops.pdl,
        "trigger": pdl.TRIGGER,
        "prefetch_bytes": gemm_cuda.PREFETCH_BYTES,
        "fused_norms": dec.ops.fused_norms,
    }
    width = ex.scheduler.config.max_blocks_per_seq

    def use(changes: dict, max_batch: int) -> None:
        ex.graphs = None
        torch.cuda.empty_cache()
        dec.ops.pdl = changes.get("pdl", saved["pdl"])
        pdl.TRIGGER = changes.get("trigger", saved["trigger"])
        gemm_cuda.PREFETCH_BYTES = changes.get("prefetch_bytes", saved["prefetch_bytes"])
        dec.ops.fused_norms = changes.get("fused_norms", saved["fused_norms"])
        dec.fold_rows = dec.norm_fold_rows(ex.config.quant)
        short = changes.get("short_context", cg.SHORT_TIER)
        ex.graphs = cg.DecodeGraphs(dec, ex.kv, max_batch, width, b.max_seq_len, ex.device, short)

    out: dict[str, list[float]] = {k: [] for k in AB_VARIANTS}
    for _ in range(args.ab_rounds):
        for name, changes in AB_VARIANTS.items():
            use(changes, b.max_batch_size if changes.get("all_buckets") else 1)
            out[name].append(round(decode_b1(), 2))
    use({}, b.max_batch_size)
    return out


def ingot_measure(engine_dir: Path, device, vocab: int, args) -> dict:
    from ingot.runtime.engine import load_engine
    from ingot.runtime.executor import Executor
    from ingot.runtime.types import SamplingParams

    sync(device)
    t = time.perf_counter()
    ex = Executor(load_engine(engine_dir, device), device, enable_prefix_reuse=False)
    sync(device)
    load_s = time.perf_counter() - t

    def serve(batch: list[list[int]], new: int) -> tuple[float, float]:
        """(seconds to the first token of the batch, seconds to finish)."""
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        sync(device)
        t0 = time.perf_counter()
        for p in batch:
            ex.add_request(p, params)
        first = None
        while ex.has_unfinished():
            ex.step()
            if first is None:
                sync(device)
                first = time.perf_counter() - t0
        sync(device)
        return first, time.perf_counter() - t0

    def ttft_samples(seed: int, pause: float = 0.0) -> dict[int, list[float]]:
        """Five lone prompts per length: seconds to the first token of each. pause: seconds
        the GPU sits idle before each (a request reaching an idle server; back to back, the
        2,048-token prefills' GEMMs run at the H200's power limit)."""
        out: dict[int, list[float]] = {}
        for n in args.ttft_lens:
            out[n] = []
            for i in range(5):
                time.sleep(pause)
                out[n].append(serve(prompts(1, n, vocab, seed + i), 1)[0])
        return out

    serve(prompts(2, 16, vocab, 1), 4)  # warm-up
    early = ttft_samples(10)
    ttft = {n: statistics.median(v) for n, v in early.items()}

    def decode_b1() -> float:
        """Batch-1 decode tok/s: one 128-token prompt, then args.decode_tokens tokens."""
        first, total = serve(prompts(1, 128, vocab, 20), args.decode_tokens)
        return (args.decode_tokens - 1) / (total - first)

    # the median of three runs (each listed): runs in one process differ by ~1% (the A/B)
    decode_b1_samples = [decode_b1() for _ in range(3)]
    _, tput = serve(prompts(args.batch, args.tput_in, vocab, 30), args.tput_out)
    # NOTE: the same TTFT once more, after the GPU has been busy for seconds: a difference
    # from the first points at warm-up (clocks, first-time costs) rather than the step itself
    late = ttft_samples(50)
    # the same lone prompts run eagerly, op by op from Python (no prefill graph): what the
    # graphs save at each length
    graphs, ex.prefill_graphs = ex.prefill_graphs, None
    eager = ttft_samples(60)
    ex.prefill_graphs = graphs
    spaced = ttft_samples(70, pause=PAUSE_S)

    def together(seed: int) -> dict[int, list[float]]:
        """Seconds to the first tokens of n 128-token prompts sent at once (one prefill step
        of them all), three times per n."""
        return {n: [serve(prompts(n, 128, vocab, seed + i), 1)[0] for i in range(3)]
                for n in CONCURRENT}  # fmt: skip

    def joining(seed: int) -> dict[int, list[float]]:
        """Seconds to the first token of a 128-token prompt sent while n requests decode (its
        prefill shares a step with their decodes), three times per n."""
        out: dict[int, list[float]] = {}
        for n in JOINING:
            out[n] = []
            for i in range(3):
                decode = SamplingParams(max_new_tokens=64, ignore_eos=True)
                for p in prompts(n, 16, vocab, seed + 10 * i):
                    ex.add_request(p, decode)
                for _ in range(4):
                    ex.step()
                sync(device)
                t0 = time.perf_counter()
                one = SamplingParams(max_new_tokens=1, ignore_eos=True)
                req = ex.add_request(prompts(1, 128, vocab, seed + 10 * i + 1)[0], one)
                while not req.output_ids:
                    ex.step()
                out[n].append(time.perf_counter() - t0)
                while ex.has_unfinished():
                    ex.step()
        return out

    # in the prefill graphs of several sequences (cuda_graphs.PREFILL_GRAPH_TIERS), then eagerly
    concurrent, joined = together(80), joining(100)
    graphs, ex.prefill_graphs = ex.prefill_graphs, None
    concurrent_eager, joined_eager = together(90), joining(100)
    ex.prefill_graphs = graphs
    m = ex.config.model
    try:  # NOTE: a failure here must not cost the other figures
        ab = decode_ab(ex, decode_b1, args)
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        ab = {"error": f"{type(e).__name__}: {e}"[:2000]}
    profile = {}
    if args.profile and device.type == "cuda":
        for n in args.ttft_lens:
            profile[f"prefill_{n}"] = kernel_profile(lambda n=n: serve(prompts(1, n, vocab, 40), 1))
        # a 128-token prefill, then 16 decode steps
        profile["prefill_128_decode_16"] = kernel_profile(
            lambda: serve(prompts(1, 128, vocab, 41), 17)
        )
    return {
        "load_s": load_s,
        "load_phases_s": ex.load_seconds,
        "kernels_in_engine": ex.kernels,
        # the tactic chosen per op (and GEMM site) and the timings that chose it
        "tactics": {
            c.name + (f"@{c.site}" if c.site else ""): {"tactic": c.tactic, "ms": c.timings_ms}
            for c in ex.config.plugins
        },
        "profile": profile,
        "decode_b1_ab_tok_s": ab,
        "kv_blocks": ex.kv.num_blocks,
        "decode_b1_tok_s": statistics.median(decode_b1_samples),
        "decode_b1_samples_tok_s": [round(x, 2) for x in decode_b1_samples],
        "ttft_ms": {str(n): v * 1e3 for n, v in ttft.items()},
        "ttft_samples_ms": {str(n): [round(x * 1e3, 3) for x in v] for n, v in early.items()},
        "ttft_late_samples_ms": {str(n): [round(x * 1e3, 3) for x in v] for n, v in late.items()},
        "ttft_spaced_samples_ms": {
            str(n): [round(x * 1e3, 3) for x in v] for n, v in spaced.items()
        },
        "ttft_eager_samples_ms": {str(n): [round(x * 1e3, 3) for x in v] for n, v in eager.items()},
        # n prompts of 128 tokens at once: "n" -> samples
        "ttft_concurrent_samples_ms": {
            str(n): [round(x * 1e3, 3) for x in v] for n, v in concurrent.items()
        },
        "ttft_concurrent_eager_samples_ms": {
            str(n): [round(x * 1e3, 3) for x in v] for n, v in concurrent_eager.items()
        },
        # a 128-token prompt joining n decoding requests: "n" -> samples
        "ttft_joining_samples_ms": {
            str(n): [round(x * 1e3, 3) for x in v] for n, v in joined.items()
        },
        "ttft_joining_eager_samples_ms": {
            str(n): [round(x * 1e3, 3) for x in v] for n, v in joined_eager.items()
        },
        f"throughput_b{args.batch}_out_tok_s": args.batch * args.tput_out / tput,
        # NOTE: what a decode step reads (the embedding and RoPE tables only a row per token)
        "weight_bytes": decode_weight_bytes(ex.decoder.w, m),
        "layers": m.num_layers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tput-in", type=int, default=128)
    ap.add_argument("--tput-out", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--ttft-lens", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel (torch.profiler)")
    ap.add_argument(
        "--ab-rounds",
        type=int,
        default=0,
        help="batch-1 decode of the AB_VARIANTS alternated this many rounds in one process",
    )
    ap.add_argument(
        "--quant",
        choices=tuple(QUANT_MODES),
        default="none",
        help="fp8: an FP8 engine (W8A8 + FP8 KV cache, calibrated by ModelOpt on --device) built "
        "with PDL, so the A/B measures PDL on FP8 (transformers eager runs the bf16 model); "
        "fp8_lm_head: the lm_head in FP8 too; int4_awq, int4_awq_lm_head: INT4 AWQ (W4A16)",
    )
    ap.add_argument("--calib-size", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=128)
    ap.add_argument(
        "--tokens-per-block", type=int, default=64,
        help="the KV-cache block size (the llama-3.1-8b-bf16 preset's)",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else LLAMA_8B
    work = args.work or Path(tempfile.mkdtemp(prefix="ingot-bench-"))
    from ingot.compiler.build import build_engine
    from ingot.compiler.convert import convert_checkpoint
    from ingot.runtime.engine import read_engine_config

    result: dict = {
        "model": ("tiny-llama" if args.tiny else "llama-3.1-8b-shaped (random bf16)")
        + (f", engine {args.quant}" if args.quant != "none" else ""),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    bandwidth = measure_bandwidth(device)
    result["bandwidth_bytes_s"] = bandwidth["bytes_per_s"]
    result["bandwidth_method"] = bandwidth["method"]
    model = make_model(shape, device, work / "hf")
    if not args.skip_hf:
        result["hf_eager"] = hf_measure(model, device, shape["vocab_size"], args)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t = time.perf_counter()
    quant = None
    if args.quant != "none":
        from ingot.compiler.quantize import QuantOptions

        mode, kv, lm_head = QUANT_MODES[args.quant]
        quant = QuantOptions(
            mode, kv, calib_size=args.calib_size, calib_max_seq_len=args.calib_len,
            device=args.device, lm_head=lm_head,
        )  # fmt: skip
    convert_checkpoint(work / "hf", work / "ckpt", dtype="bfloat16", force=True, quant=quant)
    result["convert_s"] = time.perf_counter() - t
    shutil.rmtree(work / "hf")
    target = "cpu" if device.type == "cpu" else "auto"

    def build(out: Path) -> float:
        t = time.perf_counter()
        build_engine(
            work / "ckpt",
            out,
            target=target,
            force=True,
            overrides={
                "max_batch_size": max(args.batch, 1),
                "max_seq_len": args.max_seq_len,
                "max_num_tokens": 8192,
                "tokens_per_block": args.tokens_per_block,
                # FP8 engines keep PDL opt-in; on here, so the A/B compares it with none
                "pdl": True if quant is not None and device.type == "cuda" else None,
            },
        )
        return time.perf_counter() - t

    result["build_s"] = build(work / "engine")  # PDL: on (unquantized: the default on sm_90+)
    result["build_phases_s"] = read_engine_config(work / "engine").extra["build_seconds"]
    ours = ingot_measure(work / "engine", device, shape["vocab_size"], args)
    result["ingot"] = ours
    shutil.rmtree(work / "engine")  # NOTE: 16 GB on the GPU machine's 64 GB disk
    shutil.rmtree(work / "ckpt")
    bw = result["bandwidth_bytes_s"]
    if bw:
        # NOTE: bytes per batch-1 decode step ~ every weight once (KV of a short context is small).
        ours["decode_b1_roofline_tok_s"] = bw / ours["weight_bytes"]
        ours["decode_b1_fraction_of_roofline"] = (
            ours["decode_b1_tok_s"] / ours["decode_b1_roofline_tok_s"]
        )
    if "hf_eager" in result:
        hf = result["hf_eager"]
        result["ratio_ingot_over_hf"] = {
            "decode_b1": ours["decode_b1_tok_s"] / hf["decode_b1_tok_s"],
            "throughput": ours[f"throughput_b{args.batch}_out_tok_s"]
            / hf[f"throughput_b{args.batch}_out_tok_s"],
            **{f"ttft_{n}_speedup": hf["ttft_ms"][n] / ours["ttft_ms"][n] for n in ours["ttft_ms"]},
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
