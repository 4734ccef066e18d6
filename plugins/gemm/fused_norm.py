"""RMSNorm folded into the decode GEMVs around it (contract and plain-torch reference).

A decode layer's residual add + RMSNorm kernels sit between two GEMVs: o -> norm -> gate_up,
down -> norm -> qkv. Folded, the GEMV before the norm adds its output into the residual stream
in its epilogue (`AddOut`: each program its own columns) and accumulates the rows' sums of
squares; the GEMV after it reads the residual stream as its x and normalizes each chunk as it
loads it (`NormIn`), with the scale from those sums. The norm's launch, its pass over the row
and its place on the step's critical path go; its math stays:

    h = round(residual + round(y))             (the residual stream, model dtype)
    x = round(round(h * rstd) * norm_weight)   rstd = 1 / sqrt(sum(h^2) / K + eps)

The sums are kept in fixed point, so the result does not depend on the order in which the
programs add their shares (float atomics would make the last bit of rstd vary run to run):
per row a fine int64 sum of round(share * 2^32) and a coarse one of round(share), the coarse
used when the fine would overflow (a sum of squares >= 2^30). The fixed point rounds each
share to 2^-32, so rstd differs from the norm kernel's in its last bits at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FINE = 2.0**32  # the fine sums' units per 1.0
COARSE_FROM = 2**30  # coarse sums this large or larger are used instead of the fine ones


@dataclass(frozen=True)
class NormIn:
    """The GEMM's x is the residual stream h [T, K]; it multiplies RMSNorm(h) * weight by its
    weight instead. sums: [2, T] int64, the rows' sums of squares an `AddOut` left."""

    weight: torch.Tensor  # [K], the norm's
    eps: float
    sums: torch.Tensor


@dataclass(frozen=True)
class AddOut:
    """The GEMM's output is added into `residual` [T, N] in place (h above) instead of being
    returned on its own, and h's rows' sums of squares are added into `sums` ([2, T] int64,
    zero before the first GEMM adds to them)."""

    residual: torch.Tensor
    sums: torch.Tensor


def new_sums(slots: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed sums for `slots` AddOut GEMMs of a pass over `rows` tokens: [slots, 2, rows]."""
    return torch.zeros(slots, 2, rows, dtype=torch.int64, device=device)


def fixed_point(share: torch.Tensor) -> torch.Tensor:
    """[2, T] int64 (fine, coarse) of fp32 sums of squares [T]: one program's share."""
    share = share.double()
    fine = (share * FINE + 0.5).clamp(max=2.0**62).to(torch.int64)
    return torch.stack([fine, (share + 0.5).clamp(max=2.0**62).to(torch.int64)])


def row_sums(sums: torch.Tensor) -> torch.Tensor:
    """float32 [T] sums of squares of the [2, T] fixed-point sums."""
    fine = sums[0].to(torch.float32) * (1.0 / FINE)
    return torch.where(sums[1] < COARSE_FROM, fine, sums[1].to(torch.float32))


def add_output(y: torch.Tensor, add: AddOut) -> torch.Tensor:
    """AddOut's effect given the GEMM's output y [T, N] (in the model dtype): the residual
    updated in place and returned, the sums accumulated (one share per row)."""
    r = add.residual
    h = (y.to(r.dtype).float() + r.float()).to(r.dtype)
    r.copy_(h)
    add.sums.add_(fixed_point(h.float().pow(2).sum(-1)))
    return r


def normed_input(h: torch.Tensor, norm: NormIn) -> torch.Tensor:
    """NormIn's x: RMSNorm(h) * weight [T, K] in h's dtype, from the sums."""
    rstd = 1.0 / torch.sqrt(row_sums(norm.sums) / h.shape[-1] + norm.eps)[:, None]
    x = (h.float() * rstd).to(h.dtype).float() * norm.weight.float()
    return x.to(h.dtype)
