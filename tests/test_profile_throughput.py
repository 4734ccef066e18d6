"""scripts/profile_throughput.py's split of a trace by kind of step (on made-up GPU events: the
markers and the step kinds come from the GPU run)."""

from __future__ import annotations

import pytest
from scripts_import import load_script


@pytest.fixture(scope="module")
def prof():
    return load_script("profile_throughput")


MARK = "spin_kernel(long)"
# (start, end, name) in ms (the trace's µs x 1,000: the figures are rounded to µs): warm-up
# work, then three steps: decode, mixed, decode
MS = [
    (-9.0, -8.0, "_rms_norm_kernel"),
    (0.0, 1.0, MARK),
    (2.0, 5.0, "nvjet_sm90_qqtst_128x128"),
    (6.0, 8.0, "_decode_kernel"),
    (10.0, 11.0, MARK),
    (12.0, 20.0, "nvjet_sm90_qqtst_128x128"),
    (25.0, 27.0, "_rms_norm_quant_kernel"),
    (30.0, 31.0, MARK),
    (32.0, 35.0, "nvjet_sm90_qqtst_128x128"),
]
EVENTS = [(a * 1e3, b * 1e3, name) for a, b, name in MS]


def test_step_windows_split_gpu_time_idle_and_kernels_by_kind(prof):
    out = prof.by_step_kind(EVENTS, ["decode", "mixed", "decode"])
    dec, mixed = out["decode"], out["mixed"]
    assert set(out) == {"decode", "mixed"}
    assert dec["steps"] == 2 and mixed["steps"] == 1
    # decode: (3 + 2) + 3 ms of kernels over two steps, idle (2 - 1) + (6 - 5) + (32 - 31)
    assert dec["gpu_ms_per_step"] == pytest.approx(4.0)
    assert dec["idle_ms_per_step"] == pytest.approx(1.5)
    assert dec["gpu_ms_per_step_by_group"] == {"attention": 1.0, "gemm": 3.0}
    assert dec["top"][0] == {"kernel": "nvjet_sm90_qqtst_128x128", "calls_per_step": 1.0,
                             "us_per_step": 3000.0}  # fmt: skip
    # mixed: the warm-up's norm is outside every window; the GEMM then the norm, 5 µs apart
    assert mixed["gpu_ms_per_step"] == pytest.approx(10.0)
    assert mixed["idle_ms_per_step"] == pytest.approx(6.0)
    assert mixed["gpu_ms_per_step_by_group"] == {"gemm": 8.0, "norm": 2.0}


def test_marker_count_must_match_the_launches(prof):
    out = prof.by_step_kind(EVENTS, ["decode", "mixed"])
    assert out == {"error": "3 marker kernels for 2 launched steps"}
