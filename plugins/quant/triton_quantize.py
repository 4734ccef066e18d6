"""FP8 activation quantization in Triton: x / input_scale -> float8_e4m3fn (saturated), alone or
fused into the op before a FP8 GEMM (RMSNorm, add + RMSNorm, SwiGLU).

Every kernel reproduces `reference.quantize_fp8` bit for bit: the division is IEEE (`div_rn`,
not Triton's approximate `/`), the value is clamped to +-448, then rounded to nearest-even on
the e4m3 grid. On the GPU the cast does that rounding (sm_89+: `cvt.rn.satfinite.e4m3x2.f32`,
two values per instruction); Triton's interpreter casts by truncation, so there the value is
first rounded on the grid in software (`fp8_e4m3_rne`, ~15 instructions a value, which the GPU
kernels ran too until the quantizing kernels were timed at a decode step of batch 512). The
fused variants first round their result to the activation dtype, as the unfused op would
before the GEMM quantized it, so fused and unfused engines quantize the same values.

The fused variants are the `rms_norm_quant_fp8` and `swiglu_quant_fp8` plugins an FP8 engine's
decoder runs before its GEMMs; the FP8 GEMM takes their output through
`fp8_gemm(..., out_dtype=...)` with an already-quantized x.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, pdl_begin
from ..registry import Tactic
from .row_room import empty_rows

FP8_MAX = 448.0
# the interpreter's float8 cast truncates (see the module docstring)
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

QUANTIZE_TACTICS: tuple[Tactic, ...] = (
    Tactic("b1024_w4", (("block", 1024), ("num_warps", 4))),
    Tactic("b2048_w8", (("block", 2048), ("num_warps", 8))),
    Tactic("b512_w2", (("block", 512), ("num_warps", 2))),
)


@triton.jit
def fp8_e4m3_rne(y):
    """fp32 y (already clamped to +-448) rounded to nearest-even on the float8_e4m3fn grid, as
    fp32 (so the cast to float8 afterwards is exact)."""
    a = tl.abs(y)
    # normal range (|y| >= 2^-6): keep 3 mantissa bits, ties to even, on the fp32 bit pattern
    y_bits = y.to(tl.int32, bitcast=True)
    bits = (y_bits + (0x7FFFF + ((y_bits >> 20) & 1))) & -0x100000  # -0x100000 == ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9; adding 1.5 * 2^23 rounds to an integer (nearest-even);
    # the sign is put back afterwards so that tiny negatives give -0.0 as the reference does
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub = (sub.to(tl.int32, bitcast=True) | (y_bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def quant_fp8(y, scale):
    """fp32 y / scale saturated to float8_e4m3fn (the reference's `quantize_fp8`)."""
    return to_fp8(tl.math.div_rn(y, scale))


@triton.jit
def to_fp8(q):
    """fp32 q saturated to +-448 and rounded to float8_e4m3fn, to nearest even (in software
    under the interpreter, whose own cast rounds otherwise)."""
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if _INTERPRET:
        q = fp8_e4m3_rne(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(
    x_ptr, s_ptr, out_ptr, D, sx, so, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    scale = tl.load(s_ptr)  # static: read before the wait (plugins/pdl.py)
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, quant_fp8(x, scale), mask=m)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    res_out_ptr,
    D,
    sx,
    sr,
    so,
    sro,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # the norm weight and the static scale first, before the wait (nothing writes them during
    # a forward pass, plugins/pdl.py): their DRAM round trips overlap the kernel before,
    # rather than following the sum of squares
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr)
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * sr + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * sro + cols, x, mask=m)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    # the norm plugin's result in the activation dtype: weight * (h * rstd).to(dtype)
    y = ((h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w).to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * so + cols, quant_fp8(y.to(tl.float32), scale), mask=m)


@triton.jit
def _swiglu_quant_kernel(
    x_ptr, s_ptr, out_ptr, inter, sx, so, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    scale = tl.load(s_ptr)  # static: read before the wait (plugins/pdl.py)
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * sx + inter + cols, mask=m, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)  # the swiglu plugin's result
    tl.store(out_ptr + row * so + cols, quant_fp8(y.to(tl.float32), scale), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def quantize_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    tactic: Tactic | None = None,
) -> torch.Tensor:
    """x: [..., D] (any float dtype), scale: float32 [] -> float8_e4m3fn [..., D] = x / scale,
    saturated; `out` (same shape, contiguous rows) receives it if given."""
    p = (tactic or QUANTIZE_TACTICS[0]).as_dict()
    x2 = _rows(x)
    if out is None:
        out = empty_rows(*x2.shape, torch.float8_e4m3fn, x.device).view(x.shape)
    o2 = out.view(-1, x.shape[-1])
    T, D = x2.shape
    if T == 0 or D == 0:
        return out
    block = min(int(p["block"]), triton.next_power_of_2(D))
    _quantize_kernel[(T, triton.cdiv(D, block))](
        x2,
        scale,
        o2,
        D,
        x2.stride(0),
        o2.stride(0),
        BLOCK=block,
        num_warps=int(p["num_warps"]),
        **launch_options(),
    )
    return out


def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    input_scale: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    num_warps: int = 4,
):
    """x: [T, D] -> fp8 [T, D] = quantize_fp8(rms_norm(x, weight, eps), input_scale).

    With `residual`: the add_rms_norm contract; returns (fp8 norm(residual + x), residual + x),
    the new residual in x.dtype (written into `residual_out` if given; it may alias residual).
    """
    x2 = _rows(x)
    T, D = x2.shape
    out = empty_rows(T, D, torch.float8_e4m3fn, x.device) if out is None else out
    has_res = residual is not None
    if has_res:
        r2 = _rows(residual)
        ro = torch.empty_like(x2) if residual_out is None else residual_out.view(T, D)
    else:
        r2 = ro = x2
    if T:
        _rms_norm_quant_kernel[(T,)](
            x2,
            r2,
            weight,
            input_scale,
            out,
            ro,
            D,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            ro.stride(0),
            float(eps),
            HAS_RES=has_res,
            BLOCK_D=triton.next_power_of_2(D),
            num_warps=num_warps,
            **launch_options(),
        )
    return (out, ro) if has_res else out


def swiglu_quant_fp8(
    gate_up: torch.Tensor,
    input_scale: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """gate_up: [T, 2I] -> fp8 [T, I] = quantize_fp8(silu(gate) * up, input_scale)."""
    x2 = _rows(gate_up)
    T, inter = x2.shape[0], x2.shape[1] // 2
    out = empty_rows(T, inter, torch.float8_e4m3fn, x2.device) if out is None else out
    if T and inter:
        block = min(block, triton.next_power_of_2(inter))
        _swiglu_quant_kernel[(T, triton.cdiv(inter, block))](
            x2, input_scale, out, inter, x2.stride(0), out.stride(0), BLOCK=block,
            num_warps=num_warps,
            **launch_options(),
        )  # fmt: skip
    return out


def make_rms_norm_quant_fp8(tactic: Tactic | None = None):
    """The `rms_norm_quant_fp8` plugin (the reference's contract)."""
    warps = int((tactic or QUANTIZE_TACTICS[0]).as_dict()["num_warps"])

    def fused(x, weight, eps, input_scale, residual=None):
        return rms_norm_quant_fp8(x, weight, eps, input_scale, residual, num_warps=warps)

    return fused


def make_swiglu_quant_fp8(tactic: Tactic | None = None):
    """The `swiglu_quant_fp8` plugin (the reference's contract)."""
    p = (tactic or QUANTIZE_TACTICS[0]).as_dict()
    block, warps = int(p["block"]), int(p["num_warps"])

    def fused(gate_up, input_scale):
        return swiglu_quant_fp8(gate_up, input_scale, block=block, num_warps=warps)

    return fused
