"""FP8 GEMMs on padded rows (`plugins/quant/row_room.py`, a tactic's `pad_rows`): cuBLASLt runs
the rows rounded up to PAD_ROWS_TO, on the room the quantizing kernels leave under their
output, and the output is cut back. Run here through torch's CPU `_scaled_mm`."""

from __future__ import annotations

import pytest
import torch

from ingot.plugins.quant.row_room import (
    PAD_ROWS_TO,
    empty_rows,
    in_ranges,
    padded_rows,
    row_ranges,
    with_rows,
)

pytest.importorskip("triton")
from ingot.plugins.quant import cuda_fp8  # noqa: E402
from ingot.plugins.quant.reference import fp8_matmul  # noqa: E402
from ingot.plugins.registry import Tactic  # noqa: E402

F8 = torch.float8_e4m3fn
NAN_BYTE = 0x7F  # e4m3fn NaN


def test_row_ranges_and_padding():
    assert row_ranges("16-64,449-512,8193-") == [(16, 64), (449, 512), (8193, None)]
    assert [in_ranges(row_ranges("16-64,449-"), r) for r in (15, 16, 64, 65, 449, 10**6)] == [
        False, True, True, False, True, True,
    ]  # fmt: skip
    assert PAD_ROWS_TO == 128
    assert [padded_rows(r) for r in (1, 127, 128, 129, 448, 512)] == [128, 128, 128, 256, 512, 512]


def test_room_makes_the_padded_operand_a_view_else_a_copy():
    x = empty_rows(448, 64, F8, "cpu")
    assert x.shape == (448, 64) and x.untyped_storage().nbytes() == 512 * 64
    v = with_rows(x, 512)
    assert v.shape == (512, 64) and v.data_ptr() == x.data_ptr()
    tight = torch.zeros(448, 64).to(F8)
    c = with_rows(tight, 512)
    assert c.shape == (512, 64) and c.data_ptr() != tight.data_ptr()
    assert torch.equal(c[:448].view(torch.uint8), tight.view(torch.uint8))
    # a view past its start has less room than its storage
    part = empty_rows(448, 64, F8, "cpu")[100:]
    assert with_rows(part, 412).data_ptr() == part.data_ptr()
    assert with_rows(part, 413).data_ptr() != part.data_ptr()


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """(rows, data_ptr, use_fast_accum) of each `_scaled_mm` call, run by torch on the CPU
    (which has no fast-accumulation mode); cuda_fp8 takes CPU tensors as cuBLASLt's."""
    monkeypatch.setattr(cuda_fp8, "_scaled_mm_ok", lambda *a: True)
    calls = []
    real = torch._scaled_mm

    def scaled_mm(a, b, **kw):
        calls.append((a.shape[0], a.data_ptr(), kw.pop("use_fast_accum")))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    return calls


def _nan_padded(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """x [rows, k] fp8 in room whose extra rows are NaN (what stale memory might hold)."""
    x = empty_rows(rows, k, F8, "cpu")
    x.as_strided((padded_rows(rows), k), (k, 1)).view(torch.uint8).fill_(NAN_BYTE)
    g = torch.Generator().manual_seed(seed)
    x.copy_((torch.randn(rows, k, generator=g) * 2).to(F8))
    return x


@pytest.mark.parametrize("rows", [5, 128, 200, 448])
@pytest.mark.parametrize("room", [True, False])
def test_padded_gemm_gives_the_rows_of_the_unpadded_one(scaled_mm_calls, rows, room):
    """With `pad_rows` covering x's rows, `_scaled_mm` gets them rounded up (on x's own storage
    where it has room) and fast accumulation is decided on the padded count; the result is the
    unpadded GEMM's rows exactly, NaN in the extra rows notwithstanding."""
    k, n = 64, 48
    x = _nan_padded(rows, k) if room else (torch.randn(rows, k) * 2).to(F8)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.5).to(F8)
    scales = (torch.tensor(0.5), torch.tensor(0.25))
    bias = torch.randn(n).to(torch.bfloat16)
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    plain = cuda_fp8.make_fp8_linear(t)
    # fast accumulation from the padded count on: only the padded GEMM asks for it
    pad = Tactic(t.name, t.params + (("pad_rows", "1-"),))
    padded = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(pad, f"{padded_rows(rows)}-"))
    y0 = plain(x, w, *scales, bias, out_dtype=torch.bfloat16)
    y = padded(x, w, *scales, bias, out_dtype=torch.bfloat16)
    assert y.shape == (rows, n) and y.is_contiguous()
    assert torch.isfinite(y.float()).all()
    assert torch.equal(y, y0)
    ref = fp8_matmul(x, w, scales[1], scales[0], bias, torch.bfloat16)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    (r0, _, f0), (r1, ptr, f1) = scaled_mm_calls
    assert (r0, f0) == (rows, False)  # the plain tactic: no pad_rows, no fast accumulation
    assert (r1, f1) == (padded_rows(rows), True)
    assert (ptr == x.data_ptr()) == (room or rows == padded_rows(rows))


def test_rows_outside_pad_rows_run_as_they_are(scaled_mm_calls):
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    fn = cuda_fp8.make_fp8_linear(Tactic(t.name, t.params + (("pad_rows", "385-448"),)))
    w = torch.ones(16, 32).to(F8)
    one = torch.tensor(1.0)
    for rows in (384, 385, 448, 449):
        y = fn(_nan_padded(rows, 32), w, one, one, out_dtype=torch.bfloat16)
        assert y.shape == (rows, 16)
    assert [c[0] for c in scaled_mm_calls] == [384, 512, 512, 449]


def test_the_ab_switch_runs_pad_rows_unpadded(monkeypatch, scaled_mm_calls):
    """INGOT_PAD_ROWS=0 (A/Bs on one engine) leaves the rows as they are."""
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    tactic = Tactic(t.name, t.params + (("pad_rows", "1-"),))
    monkeypatch.setenv(cuda_fp8.PAD_ROWS_ENV, "0")
    off = cuda_fp8.make_fp8_linear(tactic)
    monkeypatch.setenv(cuda_fp8.PAD_ROWS_ENV, "1")
    on = cuda_fp8.make_fp8_linear(tactic)
    w, one = torch.ones(16, 32).to(F8), torch.tensor(1.0)
    for fn in (off, on):
        assert fn(_nan_padded(200, 32), w, one, one, out_dtype=torch.bfloat16).shape == (200, 16)
    assert [c[0] for c in scaled_mm_calls] == [200, 256]


def test_fp8_attention_output_leaves_room_for_the_o_projection():
    """The attention kernels' FP8 output (the o projection's input) has the room too, also as
    the [T, Hq * hd] rows the projection takes; a model-dtype output is allocated as it is."""
    from ingot.plugins.attention.triton_decode import empty_out

    q = torch.empty(200, 4, 8, dtype=torch.bfloat16)
    o = empty_out(q, torch.tensor(0.5))
    assert o.shape == q.shape and o.dtype == F8
    rows = o.reshape(-1, 32)
    assert with_rows(rows, 256).data_ptr() == rows.data_ptr()
    plain = empty_out(q, None)
    assert plain.dtype == q.dtype and plain.untyped_storage().nbytes() == q.numel() * 2
    assert empty_out(q[:0], torch.tensor(0.5)).shape == (0, 4, 8)
