"""V written a segment of tokens at a time into a transposed (FP8) V cache, run on the CPU by
Triton's interpreter against the per-token kernel (tests/v_segment_checks.py)."""

from __future__ import annotations

import os

import pytest
from interp_rerun import rerun_with_interpreter

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_v_segments_in_the_triton_interpreter():
        rerun_with_interpreter(__file__)

else:
    import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
    from v_segment_checks import v_segments_equal_per_token

    @pytest.mark.parametrize("bs", [16, 32, 64])
    def test_v_segments_write_the_per_token_bytes(bs, monkeypatch):
        v_segments_equal_per_token(bs, "cpu", monkeypatch)

    def test_v_segments_leave_the_decode_rows_v(monkeypatch):
        # after a plain call in the same test, as the GPU test makes them (that order once
        # read the threshold the first call left patched)
        v_segments_equal_per_token(64, "cpu", monkeypatch)
        v_segments_equal_per_token(64, "cpu", monkeypatch, v_rows_cut=3)
