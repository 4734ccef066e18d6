"""Quantized GEMMs, plain torch: FP8 W8A8 with static per-tensor scales, and W4A16 (INT4 AWQ).

These are the references the GPU kernels are checked against, so they spell out the exact
arithmetic: FP8 mirrors `torch._scaled_mm` (fp8 x fp8 products accumulated in fp32, scaled by
scale_a * scale_b, bias added in fp32, one cast to the output dtype); W4A16 dequantizes the
packed weight in fp32 and multiplies in fp32.

Engine layout of an INT4 weight (plugin w4a16_gemm v2; build-engine repacks into it):
  qweight [N, K/8] int32, each row in blocks of 128 k (16 words): word c of block b holds
      w[n, 128b + 16j + c] in bits 4j..4j+3, as an unsigned code u = q + 8 (q in -8..7 for
      symmetric quantization). Interleaved so that, for one nibble position j, consecutive
      words need consecutive activations (the GEMV loads them as vectors);
  scales  [N, K/G] in the activation dtype; w[n, k] = (u - zero) * scales[n, k // G];
  zeros   None (symmetric: zero = 8) or [N, K/G] integer codes (asymmetric);
  pre_quant_scale [K]: AWQ's activation scale, applied as x * pre_quant_scale.
"""

from __future__ import annotations

import torch

from ..activation.reference import swiglu
from ..norm.reference import add_rms_norm, rms_norm

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
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x: [T, K] (bf16/fp16/fp32), weight: [N, K] float8_e4m3fn, scales: float32 [] -> [T, N].

    y = (fp8(x / input_scale) @ weight^T) * (input_scale * weight_scale) + bias, in x.dtype.
    x may also arrive quantized already (float8_e4m3fn, from a fused producer such as
    `rms_norm_quant_fp8`); then `out_dtype` says the output dtype.
    """
    xq, out_dtype = fp8_operand(x, input_scale, out_dtype, quantize_fp8)
    return fp8_matmul(xq, weight, weight_scale, input_scale, bias, out_dtype)


def fp8_operand(x, input_scale, out_dtype, quantize) -> tuple[torch.Tensor, torch.dtype]:
    """(fp8 x, output dtype) of an FP8 GEMM: x quantized by `quantize(x, input_scale)`, unless
    a fused producer already did (then the output dtype must be given)."""
    if x.dtype == torch.float8_e4m3fn:
        if out_dtype is None:
            raise ValueError("fp8_gemm: an already-quantized x needs out_dtype")
        return x, out_dtype
    return quantize(x, input_scale), out_dtype or x.dtype


def fp8_matmul(xq, weight, weight_scale, input_scale, bias, out_dtype) -> torch.Tensor:
    """fp8 [T, K] x fp8 [N, K]^T in fp32 (products of fp8 values are exact), scaled, + bias."""
    acc = xq.float() @ weight.float().t()  # [T, N]
    y = acc * (input_scale.float() * weight_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    input_scale: torch.Tensor,
    residual: torch.Tensor | None = None,
):
    """RMSNorm (after the residual add when `residual` is given), rounded to x.dtype, then
    quantized for the FP8 GEMM it feeds: fp8 [T, D], or (fp8, new residual) with residual."""
    if residual is None:
        return quantize_fp8(rms_norm(x, weight, eps), input_scale)
    y, new_residual = add_rms_norm(x, residual, weight, eps)
    return quantize_fp8(y, input_scale), new_residual


def swiglu_quant_fp8(gate_up: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> fp8 [T, I] = quantize_fp8(silu(gate) * up, input_scale)."""
    return quantize_fp8(swiglu(gate_up), input_scale)


def fp8_swiglu_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """SwiGLU, quantized with input_scale, then the FP8 GEMM: gate_up [T, 2I], weight fp8
    [N, I] -> [T, N] in out_dtype (default gate_up's dtype). The MLP's down projection."""
    act = swiglu_quant_fp8(gate_up, input_scale)
    return fp8_linear(
        act, weight, weight_scale, input_scale, bias, out_dtype=out_dtype or gate_up.dtype
    )


def fp8_qkv_rope_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    out_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 QKV projection (`fp8_linear`, output in out_dtype), then RoPE and the KV-cache
    write (`rope.reference.rope_write_kv`): -> the rotated q [T, Hq, hd]."""
    from ..gemm.reference import unfused_qkv_rope
    from ..rope.reference import rope_write_kv

    def linear(x, weight, bias):
        return fp8_linear(x, weight, weight_scale, input_scale, bias, out_dtype=out_dtype)

    return unfused_qkv_rope(
        linear, rope_write_kv, x, weight, bias, positions, cos, sin, k_cache, v_cache,
        slot_mapping, num_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def make_fp8_qkv_rope_linear(tactic=None):
    return fp8_qkv_rope_linear


def w4a16_qkv_rope_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    pre_quant_scale: torch.Tensor | None,
    group_size: int,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The W4A16 QKV projection (`w4a16_linear`), then RoPE and the KV-cache write
    (`rope.reference.rope_write_kv`): -> the rotated q [T, Hq, hd]."""
    from ..gemm.reference import unfused_qkv_rope
    from ..rope.reference import rope_write_kv

    def linear(x, qweight, bias):
        return w4a16_linear(x, qweight, scales, pre_quant_scale, group_size, zeros, bias)

    return unfused_qkv_rope(
        linear, rope_write_kv, x, qweight, bias, positions, cos, sin, k_cache, v_cache,
        slot_mapping, num_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def make_w4a16_qkv_rope_linear(tactic=None):
    return w4a16_qkv_rope_linear


def make_fp8_swiglu_linear(tactic=None):
    return fp8_swiglu_linear


def make_rms_norm_quant_fp8(tactic=None):
    return rms_norm_quant_fp8


def make_swiglu_quant_fp8(tactic=None):
    return swiglu_quant_fp8


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [R, C] integers in 0..15, C % 8 == 0 -> [R, C/8] int32, low nibble first. Built
    as bytes, two codes each (the low one in the low half), read as little-endian words."""
    r, c = codes.shape
    if c % 8:
        raise ValueError(f"INT4 packing needs a multiple of 8 codes a row, got {c}")
    u = codes.to(torch.uint8).reshape(r, c // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous().view(torch.int32)


def unpack_int4(words: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] codes in 0..15 as `dtype` (inverse of pack_int4). Read as
    bytes (4x less to move than int32 shifts): nibble 2i of a word is byte i's low half and
    nibble 2i + 1 its high half (little-endian, as every platform torch runs on)."""
    b = words.contiguous().view(torch.uint8).reshape(*words.shape, 4)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1)  # [R, C/8, 4, 2]
    return codes.reshape(words.shape[0], -1).to(dtype)


W4_BLOCK = 128  # k per interleaved block of the engine layout (16 words)


def _interleave(codes: torch.Tensor, to_engine: bool) -> torch.Tensor:
    r, c = codes.shape
    if c % W4_BLOCK:
        raise ValueError(f"INT4 engine layout needs K a multiple of {W4_BLOCK}, got {c}")
    nib, word = W4_BLOCK // 16, 16  # a block: 16 words x 8 nibbles
    shape = (r, c // W4_BLOCK, nib, word) if to_engine else (r, c // W4_BLOCK, word, nib)
    return codes.reshape(shape).transpose(2, 3).reshape(r, c)


def pack_w4_engine(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 (k in order) -> engine qweight [N, K/8] (module docstring)."""
    return pack_int4(_interleave(codes, True))


def unpack_w4_engine(words: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Engine qweight [N, K/8] -> codes [N, K] in k order (inverse of pack_w4_engine)."""
    return _interleave(unpack_int4(words, dtype), False)


def dequantize_w4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """Engine-layout INT4 (module docstring) -> dense weight [N, K] float32."""
    codes = unpack_w4_engine(qweight, torch.uint8)  # [N, K]
    n, k = codes.shape
    g = codes.view(n, k // group_size, group_size)  # a group's scale (and zero) broadcast
    q = g.float() - INT4_ZERO if zeros is None else (g.to(torch.int32) - zeros[..., None]).float()
    return (q * scales.float()[..., None]).view(n, k)


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    pre_quant_scale: torch.Tensor | None,
    group_size: int,
    zeros: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> torch.Tensor:
    """x: [T, K] -> [T, N] in x.dtype. The activation is scaled (AWQ) in x.dtype, as a kernel
    prologue would; the weight is dequantized and the product accumulated in fp32.
    gated: x is [T, 2K] (gate, then up) and the input is SwiGLU's, silu(gate) * up."""
    if gated:
        x = swiglu(x)
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
