"""The FP8 decode kernel at 128/128's decode step (512 sequences x 192 keys, Llama-3.1-8B
heads), launched a few times for Nsight Compute to profile one launch (pipe use, stall
reasons): `scripts/device_check.sh ncu` runs it under `ncu` once per tactic.

    python3 scripts/ncu_decode.py TACTIC_NAME
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch_decode import fp8_paged  # noqa: E402
from bench_kernels import HD  # noqa: E402

from ingot.plugins.attention import triton_decode as dec  # noqa: E402


def main() -> None:
    tactic = next(t for t in dec.DECODE_TACTICS if t.name == sys.argv[1])
    q, kc, vc, bt, cl, qsl, one = fp8_paged(512, 192)
    fn = dec.make_decode_attention(tactic)
    for _ in range(5):
        fn(q, kc, vc, bt, cl, qsl, 1 / math.sqrt(HD), k_scale=one, v_scale=one)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
