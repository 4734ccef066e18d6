"""The GPU engine's code paths (Triton plugins, decode and prefill graph runners) on the CPU,
through Triton's interpreter, against the CPU reference engine. Runs in CI (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from interp_rerun import interpreter_env

pytest.importorskip("triton", reason="the GPU plugins are Triton kernels")


@pytest.mark.parametrize(
    "family,quant,fold",
    [
        ("llama", "none", ""),
        ("qwen3", "none", ""),
        ("qwen2", "fp8", ""),
        ("llama", "none", "fold"),
        ("qwen2", "fp8", "fold"),
        ("llama", "int4_awq", "fold"),
    ],
)
def test_gpu_code_paths_match_the_cpu_engine(family, quant, fold):
    # NOTE: a subprocess: TRITON_INTERPRET must be set before any kernel module is imported.
    if quant != "none":
        pytest.importorskip("modelopt.torch.quantization")
    script = Path(__file__).with_name("interp_gpu_paths.py")
    r = subprocess.run(
        [sys.executable, str(script), family, quant, fold],
        env=interpreter_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"ok {family} {quant} {fold}" in r.stdout
