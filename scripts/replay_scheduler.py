"""Replays the scheduler (the C++ core, no model) over an offline-throughput workload and counts
how a step's prompt rows fall into the FP8 pool's V windows (SEG = 32 slots of one block from a
32-slot boundary; plugins/attention/triton_kv_write.py). On the CPU, in seconds.

    python3 scripts/replay_scheduler.py --input-len 2048 --output-len 128 --num-requests 512

Per kind of step (decode-only, prefill-only, mixed): steps, and over their prompt rows:
`row_grid_whole`, the 32-row groups from row 0 whose slots are one whole window in order (what
the V-segments kernel stored 16 bytes at a time until it followed runs of slots), and
`windows_whole` / `windows_partial`, the windows the prompt rows write whole or in part (a
chunk's first and last), which it stores now. Pool and limits: the FP8 engine's on the H200.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ingot.cli.bench.metrics import StepMix
from ingot.runtime.scheduler import Scheduler, SchedulerConfig

SEG = 32


def prompt_rows(plan) -> int:
    """Rows of the step's prompt chunks: all but its trailing one-token decodes."""
    decodes = plan.num_seqs - plan.num_prefill
    return plan.num_tokens - decodes


def count(slots: np.ndarray) -> dict[str, int]:
    """The three counts for one step's prompt-row slots."""
    n = len(slots) // SEG * SEG
    groups = slots[:n].reshape(-1, SEG)
    in_order = (groups == groups[:, :1] + np.arange(SEG)).all(axis=1) & (groups[:, 0] % SEG == 0)
    windows = np.unique(slots // SEG, return_counts=True)[1]
    return {
        "row_grid_groups": -(-len(slots) // SEG),
        "row_grid_whole": int(in_order.sum()),
        "windows_whole": int((windows == SEG).sum()),
        "windows_partial": int((windows < SEG).sum()),
    }


def replay(input_len: int, output_len: int, num_requests: int, args) -> dict:
    cfg = SchedulerConfig(num_blocks=args.num_blocks, tokens_per_block=args.block_size,
                          max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                          max_seq_len=args.max_seq_len)  # fmt: skip
    sched = Scheduler(cfg)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        sched.add_request(i, rng.integers(0, 32000, input_len, dtype=np.int32), output_len)
    out: dict[str, dict[str, int]] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        if plan.num_seqs == 0:
            break
        row = out.setdefault(StepMix.kind(plan.num_seqs, plan.num_prefill), {"steps": 0})
        row["steps"] += 1
        rows = prompt_rows(plan)
        if rows:
            for k, v in count(plan.slot_mapping[:rows].astype(np.int64)).items():
                row[k] = row.get(k, 0) + v
        n = plan.num_seqs
        sched.update(np.zeros(n, np.int32), np.zeros(n, np.int8))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--num-blocks", type=int, default=59785)  # the H200's FP8 pool
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=512)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    args = ap.parse_args()
    result = replay(args.input_len, args.output_len, args.num_requests, args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
