"""Host time of an executor step outside the model: scheduling, sampling bookkeeping, updates.

The decoder is stubbed (the step's logits come back at once), so what is timed is the Python
and C++ work that sits between two GPU steps, at batch sizes up to an engine's maximum. Runs
on the CPU with a tiny engine built on the spot.

    python3 scripts/bench_host_step.py --out host_step.json [--batch 1 64 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.examples import make_tiny_hf_model
from ingot.runtime.engine import load_engine
from ingot.runtime.executor import Executor
from ingot.runtime.types import SamplingParams


def step_us(engine: Path, batch: int, steps: int) -> float:
    """Median microseconds of a decode step of `batch` greedy requests, logits stubbed."""
    ex = Executor(load_engine(engine), torch.device("cpu"), enable_prefix_reuse=False)
    vocab = ex.config.model.vocab_size
    prefill = ex._logits

    def stub(plan, rows, ids=None):
        if plan.num_prefill:
            return prefill(plan, rows, ids)
        n = len(rows)
        return torch.zeros(n, vocab), torch.full((n,), 5)

    ex._logits = stub
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ex.add_request([3 + i % 50] * 16, params)
    while any(not r.output_ids for r in ex.requests.values()):
        ex.step()  # prefills (real model) until every request decodes
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        ex.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ingot-host-"))
    hf = make_tiny_hf_model("llama", root / "hf", seed=1)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    build = {"max_batch_size": max(args.batch), "max_seq_len": 256, "tokens_per_block": 16}
    engine = build_engine(ckpt, root / "engine", target="cpu", overrides=build)
    result = {"steps": args.steps, "us_per_step": {}}
    for b in args.batch:
        result["us_per_step"][str(b)] = round(step_us(engine, b, args.steps), 1)
        print(f"batch {b:4d}: {result['us_per_step'][str(b)]:8.1f} us per step (host)")
    args.out.write_text(json.dumps(result, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
