"""RMSNorm and fused residual-add + RMSNorm in Triton; same contracts as `reference.py`.

One program normalises ROWS rows of D elements; the whole row sits in registers (D <= 16K), so
each input is read once and each output written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..registry import Tactic

RMS_NORM_TACTICS: tuple[Tactic, ...] = (
    Tactic("w8", (("num_warps", 8),)),
    Tactic("w4", (("num_warps", 4),)),
    Tactic("w16", (("num_warps", 16),)),
    Tactic("w4_r2", (("num_warps", 4), ("rows", 2))),
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    D,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    # the norm weight before the wait: nothing writes it during a forward pass (plugins/pdl.py)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    pdl_begin(PDL)
    pid = tl.program_id(0)
    for i in tl.static_range(ROWS):
        row = pid * ROWS + i
        if row < n_rows:
            x = tl.load(x_ptr + row * stride_x + cols, mask=cmask, other=0.0)
            if HAS_RES:
                r = tl.load(res_ptr + row * stride_r + cols, mask=cmask, other=0.0)
                # NOTE: the reference rounds residual + x to the activation dtype before the norm.
                s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_ptr + row * stride_ro + cols, s, mask=cmask)
                h = s.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
                # reference: weight * (h * rstd).to(residual dtype)
                y = (h * rstd).to(res_out_ptr.dtype.element_ty).to(tl.float32) * w
            else:
                h = x.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
                y = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
            tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


def _launch(x2, res2, weight, eps, out2, res_out2, params):
    n, d = x2.shape
    rows = int(params.get("rows", 1))
    block_d = triton.next_power_of_2(d)
    grid = (triton.cdiv(n, rows),)
    if n == 0:
        return
    _rms_norm_kernel[grid](
        x2,
        res2 if res2 is not None else x2,
        weight,
        out2,
        res_out2 if res_out2 is not None else out2,
        n,
        d,
        x2.stride(0),
        res2.stride(0) if res2 is not None else 0,
        out2.stride(0),
        res_out2.stride(0) if res_out2 is not None else 0,
        float(eps),
        HAS_RES=res2 is not None,
        ROWS=rows,
        BLOCK_D=block_d,
        num_warps=int(params.get("num_warps", 8)),
        **launch_options(),
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def make_rms_norm(tactic: Tactic | None = None):
    params = (tactic or RMS_NORM_TACTICS[0]).as_dict()

    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [..., D], weight: [D] -> [..., D]; `out` (same shape, contiguous) is optional."""
        x2 = _rows(x)
        if out is None:
            out = torch.empty(
                x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
            )
        _launch(x2, None, weight, eps, out.view(-1, x.shape[-1]), None, params)
        return out

    return rms_norm


def make_add_rms_norm(tactic: Tactic | None = None):
    params = (tactic or RMS_NORM_TACTICS[0]).as_dict()

    def add_rms_norm(
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(residual + x), residual + x). `residual_out` may alias `residual`
        (in-place update: each element is read before it is written by the same program)."""
        x2, r2 = _rows(x), _rows(residual)
        if residual_out is None:
            residual_out = torch.empty(
                x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
            )
        if out is None:
            out = torch.empty(
                x.shape,
                dtype=torch.promote_types(residual_out.dtype, weight.dtype),
                device=x.device,
            )
        d = x.shape[-1]
        _launch(x2, r2, weight, eps, out.view(-1, d), residual_out.view(-1, d), params)
        return out, residual_out

    return add_rms_norm
