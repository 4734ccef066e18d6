"""Quantized GEMMs, plain torch: FP8 W8A8 with static per-tensor scales, and W4A16 (INT4 AWQ).

These are the references the GPU kernels are checked against, so they spell out the exact
arithmetic: FP8 mirrors `torch._scaled_mm` (fp8 x fp8 products accumulated in fp32, scaled by
scale_a * scale_b, bias added in fp32, one cast to the output dtype); W4A16 dequantizes the
packed weight in fp32 and multiplies in fp32.

Engine layout of an INT4 weight (plugin w4a16_gemm v1; build-engine repacks into it):
  qweight [K/8, N] int32: word (r, n) holds w[n, 8r + j] in bits 4j..4j+3 (low nibble first),
      as an unsigned code u = q + 8 (q in -8..7 for symmetric quantization);
  scales  [K/G, N] in the activation dtype; w[n, k] = (u - zero) * scales[k // G, n];
  zeros   None (symmetric: zero = 8) or [K/G, N] integer codes (asymmetric);
  pre_quant_scale [K]: AWQ's activation scale, applied as x * pre_quant_scale.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_ZERO = 8  # implicit zero point of symmetric int4 codes


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448, as float8_e4m3fn (same shape)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, K] (bf16/fp16/fp32), weight: [N, K] float8_e4m3fn, scales: float32 [] -> [T, N].

    y = (fp8(x / input_scale) @ weight^T) * (input_scale * weight_scale) + bias, in x.dtype.
    """
    xq = quantize_fp8(x, input_scale)  # [T, K] fp8
    acc = xq.float() @ weight.float().t()  # [T, N] fp32, exact products of fp8 values
    y = acc * (input_scale.float() * weight_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [R, C] integers in 0..15, C % 8 == 0 -> [R, C/8] int32, low nibble first."""
    r, c = codes.shape
    u = codes.to(torch.int64).reshape(r, c // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (u << shifts).sum(dim=-1)  # [R, C/8] in 0..2^32-1
    words = torch.where(words >= 2**31, words - 2**32, words)  # wrap into int32
    return words.to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] int32 codes in 0..15 (inverse of pack_int4)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    codes = (words[..., None] >> shifts) & 0xF  # [R, C/8, 8]
    return codes.reshape(words.shape[0], -1)


def dequantize_w4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """Engine-layout INT4 (module docstring) -> dense weight [N, K] float32."""
    codes = unpack_int4(qweight.t().contiguous())  # [N, K]: K packs along the last dim
    s = scales.float().t().repeat_interleave(group_size, dim=1)  # [N, K]
    z = INT4_ZERO if zeros is None else zeros.t().repeat_interleave(group_size, dim=1)
    return (codes - z).float() * s


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    pre_quant_scale: torch.Tensor | None,
    group_size: int,
    zeros: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, K] -> [T, N] in x.dtype. The activation is scaled (AWQ) in x.dtype, as a kernel
    prologue would; the weight is dequantized and the product accumulated in fp32."""
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.to(x.dtype)
    w = dequantize_w4(qweight, scales, group_size, zeros)  # [N, K] fp32
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def make_fp8_linear(tactic=None):
    return fp8_linear


def make_w4a16_linear(tactic=None):
    return w4a16_linear
