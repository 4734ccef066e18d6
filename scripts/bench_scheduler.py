"""Scheduler step time (schedule + update) in steady decode: the C++ core vs plain Python.

The plain-Python implementation of the same plan is tests/sched_model.py (the model the
property tests check the core against); this script imports it from the repo's tests/ folder.
Each request holds a ~2,048-token context in 16-token blocks and decodes one token per step.

    python scripts/bench_scheduler.py --out out/bench_scheduler.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sched_model import ModelScheduler  # noqa: E402

from ingot.runtime.scheduler import Scheduler, SchedulerConfig  # noqa: E402

TPB, CONTEXT, MAX_SEQ_LEN, MAX_NUM_TOKENS = 16, 2048, 2304, 65536


def make_config(n: int) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=n * (MAX_SEQ_LEN // TPB),
        tokens_per_block=TPB,
        max_batch_size=n,
        max_num_tokens=MAX_NUM_TOKENS,
        max_seq_len=MAX_SEQ_LEN,
        policy="max_utilization",
        enable_prefix_reuse=True,
    )


def fill(sched, n: int, seed: int = 0) -> None:
    """Adds n requests and runs prefill until every one decodes."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        sched.add_request(i, rng.integers(0, 32000, CONTEXT - 1, dtype=np.int32), 10_000)
    while True:
        plan = sched.schedule()
        b, prefill = _sizes(plan)
        sched.update(np.ones(b, np.int32), np.zeros(b, np.int8))
        if prefill == 0:
            return


def _sizes(plan) -> tuple[int, int]:
    if isinstance(plan, dict):
        return plan["num_seqs"], plan["num_prefill"]
    return plan.num_seqs, plan.num_prefill


def time_steps(sched, n: int, steps: int) -> list[float]:
    new = np.ones(n, np.int32)
    fin = np.zeros(n, np.int8)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        plan = sched.schedule()
        sched.update(new, fin)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        assert _sizes(plan) == (n, 0)
    return out


def summarize(us: list[float]) -> dict:
    a = np.array(us)
    return {
        "mean_us": round(float(a.mean()), 2),
        "p50_us": round(float(np.median(a)), 2),
        "p99_us": round(float(np.percentile(a, 99)), 2),
        "max_us": round(float(a.max()), 2),
        "steps": len(us),
    }


def same_plan(n: int) -> bool:
    """The core and the model plan the same step (checked on a small pool before timing)."""
    core = Scheduler(make_config(n))
    ref = ModelScheduler(
        **{
            k: getattr(make_config(n), k)
            for k in (
                "num_blocks",
                "tokens_per_block",
                "max_batch_size",
                "max_num_tokens",
                "max_seq_len",
                "policy",
                "enable_prefix_reuse",
            )
        }
    )
    fill(core, n)
    fill(ref, n)
    a, b = core.schedule(), ref.schedule()
    return all(
        np.array_equal(getattr(a, k), b[k])
        for k in ("seq_ids", "slot_mapping", "block_tables", "context_lens")
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=150, help="timed core steps per size (<= 200)")
    ap.add_argument("--py-steps", type=int, default=20, help="timed plain-Python steps per size")
    args = ap.parse_args()
    args.steps = min(args.steps, 200)  # NOTE: contexts must stay below MAX_SEQ_LEN
    results = []
    for n in args.sizes:
        core = Scheduler(make_config(n))
        fill(core, n)
        time_steps(core, n, 10)  # warm-up
        core_us = summarize(time_steps(core, n, args.steps))
        ref = ModelScheduler(
            n * (MAX_SEQ_LEN // TPB), TPB, n, MAX_NUM_TOKENS, MAX_SEQ_LEN, "max_utilization", True
        )
        fill(ref, n)
        time_steps(ref, n, 2)
        py_us = summarize(time_steps(ref, n, args.py_steps))
        results.append(
            {
                "num_requests": n,
                "context_tokens": CONTEXT,
                "tokens_per_block": TPB,
                "core": core_us,
                "plain_python": py_us,
                "speedup": round(py_us["mean_us"] / core_us["mean_us"], 1),
            }
        )
    report = {
        "benchmark": "scheduler step (schedule + update), steady decode",
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "same_plan_as_python": same_plan(8),
        "goal": "core mean < 50 us per step at 256 requests",
        "results": results,
    }
    r256 = [r for r in results if r["num_requests"] == 256]
    if r256:
        report["meets_goal"] = r256[0]["core"]["mean_us"] < 50.0
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
