"""Re-run a test module in a fresh process with Triton's interpreter on (TRITON_INTERPRET is
read when a kernel module is imported, so it cannot be switched on inside the suite)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def interpreter_env(shard: str | None = None) -> dict[str, str]:
    """This process's environment with Triton's interpreter on and the shard ("i/n", or none:
    the parent's own INGOT_TEST_SHARD never leaks into the child)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("INGOT_TEST_SHARD", None)
    if shard:
        env["INGOT_TEST_SHARD"] = shard
    return env


def rerun_with_interpreter(module_file: str, shard: str | None = None) -> None:
    """Run `module_file`'s tests under TRITON_INTERPRET=1; fail with their output if any fails.

    shard "i/n": only every n-th of its tests from the i-th (conftest's INGOT_TEST_SHARD), so
    that a long module runs as n tests that xdist's workers share."""
    pytest.importorskip("triton")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", module_file],
        env=interpreter_env(shard),
        capture_output=True,
        text=True,
        # test_quant_kernels_interp.py took 501-822 s unsharded on the CI machine kind
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout
