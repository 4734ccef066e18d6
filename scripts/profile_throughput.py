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

`by_step_kind` in the JSON: the GPU time of decode-only, prefill-only and mixed steps apart,
per step (GPU time by group, idle time, the largest kernels). A marker kernel goes into the
stream before each step's launch, so the GPU work from one marker to the next is that step's
(its sampling readback included).
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
from ingot.cli.bench.metrics import StepMix  # noqa: E402
from ingot.cli.bench.workload import point_seed, synthetic  # noqa: E402

# torch.cuda._sleep's kernel (ATen's Sleep.cu), launched before each step as its marker
MARKER = re.compile(r"\bspin_kernel\b")

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
    kinds = mark_steps(driver.executor)
    events: list[tuple[float, float, str]] = []
    prof = kernel_profile(run, top=80, events_out=events)
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
            "by_step_kind": by_step_kind(events, kinds),
            "profile": prof,
        },
    )
    keys = ("wall_s", "step_mix", "gpu_ms_by_group", "by_step_kind")
    print(json.dumps({k: out[k] for k in keys}, indent=2))
    print(f"GPU busy {prof['gpu_us_total'] / 1e3:.1f} ms, idle {prof.get('idle_us', 0) / 1e3:.1f}"
          f" ms of a {prof.get('span_us', 0) / 1e3:.1f} ms span")  # fmt: skip


def mark_steps(executor) -> list[str]:
    """Wraps the executor's step launch: a marker kernel in the stream first, then the step's
    work. Returns the launched steps' kinds (StepMix.kind), in launch order, as they come."""
    kinds: list[str] = []
    launch = executor._launch

    def marked(plan, *args, **kw):
        torch.cuda._sleep(1)
        kinds.append(StepMix.kind(plan.num_seqs, plan.num_prefill))
        return launch(plan, *args, **kw)

    executor._launch = marked
    return kinds


def by_step_kind(events: list[tuple[float, float, str]], kinds: list[str], top: int = 12) -> dict:
    """Per kind of step, per step: GPU time by group (group_of), GPU idle time and the `top`
    kernels. events: (start, end, name) in µs by start; the i-th marker kernel opens the
    window of the i-th launched step (kinds[i]), which lasts to the next marker (the last one
    to the end of the trace). Work before the first marker is left out. A trace whose marker
    count differs from the launches gives {"error": ...}."""
    marks = [i for i, e in enumerate(events) if MARKER.search(e[2])]
    if len(marks) != len(kinds):
        return {"error": f"{len(marks)} marker kernels for {len(kinds)} launched steps"}
    acc: dict[str, dict] = {}
    for n, (first, kind) in enumerate(zip(marks, kinds, strict=True)):
        last = marks[n + 1] if n + 1 < len(marks) else len(events)
        a = acc.setdefault(kind, {"steps": 0, "gpu_us": 0.0, "idle_us": 0.0, "groups": {},
                                  "kernels": {}})  # fmt: skip
        a["steps"] += 1
        end = events[first][1]
        for start, stop, name in events[first + 1 : last]:
            a["idle_us"] += max(0.0, start - end)
            end = max(end, stop)
            us = stop - start
            a["gpu_us"] += us
            g = group_of(name)
            a["groups"][g] = a["groups"].get(g, 0.0) + us
            calls_us = a["kernels"].setdefault(name[:100], [0, 0.0])
            calls_us[0] += 1
            calls_us[1] += us
    out = {}
    for kind, a in acc.items():
        n = a["steps"]
        biggest = sorted(a["kernels"].items(), key=lambda kv: -kv[1][1])[:top]
        out[kind] = {
            "steps": n,
            "gpu_ms_per_step": round(a["gpu_us"] / n / 1e3, 3),
            "idle_ms_per_step": round(a["idle_us"] / n / 1e3, 3),
            "gpu_ms_per_step_by_group": {
                g: round(us / n / 1e3, 3) for g, us in sorted(a["groups"].items())
            },
            "top": [
                {"kernel": k, "calls_per_step": round(c / n, 2), "us_per_step": round(us / n, 1)}
                for k, (c, us) in biggest
            ],
        }
    return out


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
