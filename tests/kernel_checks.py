"""What every kernel test compares: relative error against a reference (NaN anywhere, e.g. an
unwritten element of a poisoned output, fails at once) and bit equality of FP8 tensors."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or bad masking)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both float8_e4m3fn with identical bytes."""
    f8 = torch.float8_e4m3fn
    return a.dtype == b.dtype == f8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
