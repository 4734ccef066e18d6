"""Re-run a test module in a fresh process with Triton's interpreter on (TRITON_INTERPRET is
read when a kernel module is imported, so it cannot be switched on inside the suite)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def rerun_with_interpreter(module_file: str) -> None:
    """Run `module_file`'s tests under TRITON_INTERPRET=1; fail with their output if any fails."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", module_file],
        env=env,
        capture_output=True,
        text=True,
        # test_quant_kernels_interp.py alone took 501 s on the CI machine kind (2026-12-05)
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout
