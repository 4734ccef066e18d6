"""Where an offline-throughput run's GPU time goes: one `ingot bench throughput`-style run of an
engine under torch.profiler, with the step mix (decode-only / prefill-only / mixed steps) and
the GPU time per kernel, grouped by what the kernel does.

    python scripts/profile_throughput.py ENGINE_DIR --input-len 128 --output-len 128 \\
        --num-requests 1024 --out out/profile_128_128.json          # on the H200

Same workload (seed and all) as the bench's throughput point of that shape, so the figures
line up with its JSON; the profiler itself slows the host a little, so wall times are upper
bounds. Writes JSON; prints the groups.

`--host`: the same run under cProfile instead, for where the host's time goes (the functions
with the most time of their own and with the most time under them): the executor plans and
launches a mixed step while the GPU runs the one before (`next` in the bench's `step_mix`),
and past the GPU's time per step the host is what the run waits for. Also runs on the CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import kernel_profile  # noqa: E402

from ingot.cli.bench.ingot_driver import IngotDriver  # noqa: E402
from ingot.cli.bench.workload import point_seed, synthetic  # noqa: E402

# first match wins; kernel names of cuBLAS(Lt) GEMMs vary by version, hence the loose patterns
GROUPS = (
    ("gemm", r"gemm|cutlass|xmma|nvjet|gemv|_mm_|matmul|scaled_mm|sm90"),
    ("attention", r"attention|attn|paged|_prefill_kernel|_decode_kernel|decode_reduce"),
    ("rope_kv_write", r"rope|kv_write|kv_cache"),
    ("norm", r"norm"),
    ("swiglu_quant", r"swiglu|silu|quant"),
    ("sampling", r"argmax|max|topk|sort|softmax"),
    ("copies", r"copy|memcpy|memset|cat|index|gather|fill|elementwise"),
)


def group_of(kernel: str) -> str:
    name = kernel.lower()
    return next((g for g, pat in GROUPS if re.search(pat, name)), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--host", action="store_true", help="profile the host (cProfile), not the GPU")
    args = ap.parse_args()
    if not args.host and not torch.cuda.is_available():
        sys.exit("profile_throughput.py needs a CUDA GPU")
    driver = IngotDriver(args.engine_dir)
    vocab = driver.executor.config.model.vocab_size
    name = f"throughput_in{args.input_len}_out{args.output_len}"
    work = synthetic(
        args.num_requests, args.input_len, args.output_len, vocab, point_seed(args.seed, name)
    )
    # warm-up: this prompt length's first-use costs (GEMM heuristics, allocator growth)
    driver.run(synthetic(8, args.input_len, 4, vocab, seed=2**31 - 3))
    result = {}

    def run() -> None:
        t = time.perf_counter()
        r = driver.run(work)
        result.update(wall_s=time.perf_counter() - t, step_mix=r.extra["step_mix"])

    if args.host:
        host = host_profile(run)
        write(args, result, {"host_profile": host})
        for row in host["by_own_time"][:15]:
            print(f"{row['own_s']:9.3f} s own {row['cum_s']:9.3f} s cum {row['calls']:>9} x "
                  f"{row['function']}")  # fmt: skip
        return
    prof = kernel_profile(run, top=80)
    groups: dict[str, float] = {}
    for row in prof["top"]:
        g = group_of(row["kernel"])
        groups[g] = groups.get(g, 0.0) + row["us"]
    listed = sum(r["us"] for r in prof["top"])
    groups["not_in_top_80"] = prof["gpu_us_total"] - listed
    out = write(
        args,
        result,
        {
            "gpu_ms_by_group": {g: round(us / 1e3, 2) for g, us in sorted(groups.items())},
            "profile": prof,
        },
    )
    print(json.dumps({k: out[k] for k in ("wall_s", "step_mix", "gpu_ms_by_group")}, indent=2))
    print(f"GPU busy {prof['gpu_us_total'] / 1e3:.1f} ms, idle {prof.get('idle_us', 0) / 1e3:.1f}"
          f" ms of a {prof.get('span_us', 0) / 1e3:.1f} ms span")  # fmt: skip


def host_profile(run, top: int = 40) -> dict:
    """cProfile over one call of `run`: the `top` functions by own time and by cumulative
    time, each with its call count and seconds."""
    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, own, cum, ...)

    def rows(key: int) -> list[dict]:
        best = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"function": f"{Path(f).name}:{line}({name})", "calls": st[1],
                 "own_s": round(st[2], 4), "cum_s": round(st[3], 4)}
                for (f, line, name), st in best]  # fmt: skip

    return {"by_own_time": rows(2), "by_cumulative_time": rows(3)}


def write(args, result: dict, extra: dict) -> dict:
    out = {
        "engine_dir": str(args.engine_dir),
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_requests": args.num_requests,
            "seed": args.seed,
        },
        "output_tok_s_under_profiler": args.num_requests * args.output_len / result["wall_s"],
        **result,
        **extra,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
