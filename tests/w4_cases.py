"""Shared by the W4A16 interpreter tests: a random INT4 case with its reference output, and a
kernel stand-in that records its launches."""

from __future__ import annotations

import torch

from ingot.plugins.quant import reference as qref


def w4_case(K: int, N: int, T: int, dtype, bias: bool, pqs: bool = True):
    """(x, qweight, scales, pre_quant_scale, bias) of a random [N, K] group-128 layer in the
    engine layout, and the reference output for x [T, K]."""
    codes = torch.randint(0, 16, (N, K))
    qweight = qref.pack_w4_engine(codes)  # [N, K/8]
    scales = (torch.rand(N, K // 128) * 0.02 + 0.005).to(dtype)
    p = (torch.rand(K) + 0.5).to(dtype) if pqs else None
    x = torch.randn(T, K).to(dtype)
    b = torch.randn(N).to(dtype) if bias else None
    ref = qref.w4a16_linear(x, qweight, scales, p, 128, None, b)
    return (x, qweight, scales, p, b), ref


class Spy:
    """A kernel whose launches record their keyword arguments."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    @staticmethod
    def calls_of(fn, calls: list):
        """fn, its calls' positional arguments appended to `calls`."""
        return lambda *a, **kw: calls.append(a) or fn(*a, **kw)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw)
            return self.kernel[grid](*args, **kw)

        return launch
