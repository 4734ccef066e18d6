"""SwiGLU on a fused gate/up projection in Triton; same contract as `reference.swiglu`.

Grid (row, column block): each program reads BLOCK gate and BLOCK up values of one row and
writes silu(gate) * up, computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..registry import Tactic

SWIGLU_TACTICS: tuple[Tactic, ...] = (
    Tactic("b1024_w4", (("block", 1024), ("num_warps", 4))),
    Tactic("b512_w4", (("block", 512), ("num_warps", 4))),
    Tactic("b2048_w8", (("block", 2048), ("num_warps", 8))),
    Tactic("b256_w2", (("block", 256), ("num_warps", 2))),
)


@triton.jit
def _swiglu_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def make_swiglu(tactic: Tactic | None = None):
    params = (tactic or SWIGLU_TACTICS[0]).as_dict()
    block = int(params.get("block", 1024))
    num_warps = int(params.get("num_warps", 4))

    def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up: [T, 2I] (gate first, then up) -> silu(gate) * up: [T, I]."""
        x = gate_up.reshape(-1, gate_up.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        n, two_i = x.shape
        inter = two_i // 2
        if out is None:
            out = torch.empty(
                *gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device
            )
        if n:
            o2 = out.view(-1, inter)
            _swiglu_kernel[(n, triton.cdiv(inter, block))](
                x,
                o2,
                inter,
                x.stride(0),
                o2.stride(0),
                BLOCK=block,
                num_warps=num_warps,
                **launch_options(),
            )
        return out

    return swiglu
