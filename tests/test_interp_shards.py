"""interp_rerun's shards: together they run each of a module's tests exactly once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from interp_rerun import interpreter_env

MODULE = str(Path(__file__).parent / "test_quant_kernels_interp.py")


def _collected(shard: str | None) -> list[str]:
    pytest.importorskip("triton")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", MODULE],
        env=interpreter_env(shard), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_shards_partition_the_module():
    every = _collected(None)
    shards = [_collected(f"{i}/4") for i in range(4)]
    assert len(every) > 100 and all(shards)
    assert sorted(sum(shards, [])) == sorted(every)
    # round robin: a slow function's cases (adjacent when collected) go to every shard
    assert all(any("::test_w4a16_shapes[" in t for t in s) for s in shards)
