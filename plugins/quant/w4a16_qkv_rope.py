"""The INT4 AWQ (W4A16) QKV projection with RoPE and the KV-cache write in its epilogue (plugin
w4a16_qkv_rope_gemm; decode-sized batches): `plugins/gemm/qkv_rope.py`'s epilogue after the
W4A16 GEMV of `triton_w4a16.py` (its fp32 or packed loop, by the tactic), whose programs own
weight rows in RoPE pairs. One launch per layer fewer than the GEMV then the RoPE + KV-write
kernel, with the same bits (the sum is rounded to the model dtype first, as the GEMV stores
it). Past the tactic's max_m rows, or for calls the GEMV does not take, the W4A16 plugin of the
same tactic, then the RoPE + KV-write kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm.cuda import norm_args
from ..gemm.fused_norm import NormIn
from ..gemm.qkv_rope import rope_epilogue, rope_inputs, rope_output, rope_pair_rows
from ..gemm.reference import unfused_qkv_rope
from ..pdl import launch_options
from ..registry import Tactic
from ..rope.triton_kernels import make_rope_write_kv
from . import triton_w4a16 as tw
from .reference import W4_BLOCK


@triton.jit
def _w4a16_qkv_rope_kernel(
    x_ptr, qw_ptr, s_ptr, pqs_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr,
    slot_ptr, ks_ptr, vs_ptr, T, N, KB, sxm, magic, magic2, c136, sqt, sqh, s_cos,
    sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h, sv_d, HQ, HKV,
    HALF: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr, HAS_PQS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCKS_PER_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr,
    PACKED: tl.constexpr, PDL: tl.constexpr = False, NORM: tl.constexpr = False, wn_ptr=None,
    ss_ptr=None, eps=0.0, sss=0,
):  # fmt: skip
    """Grid: (HQ + 2 HKV) heads x HALF / (BLOCK_N / 2) programs (`rope_pair_rows`); the
    W4A16 GEMV's arguments (`triton_w4a16._w4a16_gemv_kernel`), then the epilogue's
    (`qkv_rope._qkv_rope_kernel`). PACKED: the bf16x2 loop (bf16 x)."""
    h, d, rn = rope_pair_rows(HALF, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    mm = rm < T
    c1, c2, s1, s2, slot, ok, ks, vs = rope_inputs(pos_ptr, cos_ptr, sin_ptr, slot_ptr, ks_ptr,
                                                   vs_ptr, tl.where(mm, rm, 0), mm, d, s_cos,
                                                   HALF, KV_FP8)  # fmt: skip
    # (the step inputs above may be read before the PDL wait: plugins/pdl.py)
    y, _, rn_c, _, _ = tw.w4a16_rows(
        x_ptr, qw_ptr, s_ptr, pqs_ptr, rn, T, N, KB, sxm, magic, magic2, c136, HAS_PQS,
        BLOCKS_PER_GROUP, BLOCK_M, BLOCK_N, BLOCK_G, MASKED, STAGES, False, PACKED, NORM,
        wn_ptr, ss_ptr, sss, eps, PDL,
    )  # fmt: skip
    if HAS_BIAS:
        y += tl.load(b_ptr + rn_c).to(tl.float32)[None, :]
    rope_epilogue(y, h, d, rm, mm, c1, c2, s1, s2, slot, ok, ks, vs, q_ptr, kc_ptr, vc_ptr,
                  sqt, sqh, sk_blk, sk_tok, sk_h, sv_blk, sv_tok, sv_h, sv_d, HQ, HKV,
                  HALF, BS, KV_FP8, BLOCK_M, BLOCK_N)  # fmt: skip


def fusable(x, qweight, scales, pre_quant_scale, group_size, zeros, bias, num_heads,
            num_kv_heads, params: dict, norm: NormIn | None = None) -> bool:  # fmt: skip
    """Whether the fused kernel takes this call (params: the tactic's GEMV half)."""
    heads = num_heads + 2 * num_kv_heads
    if (
        x.dim() != 2
        or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
        or not 0 < x.shape[0] <= int(params.get("max_m", 1))
        or qweight.shape[0] % heads
        or x.device.type not in tw._KERNEL_DEVICES
    ):
        return False
    half, hb = qweight.shape[0] // heads // 2, int(params["block_n"]) // 2
    return (
        hb > 0
        and half % hb == 0
        and tw.kernel_ok(x, qweight, scales, pre_quant_scale, group_size, zeros, bias, W4_BLOCK)
        and tw.folds_ok(x, qweight, norm, None)
    )


def make_w4a16_qkv_rope_linear(tactic: Tactic | None = None):
    dec, _ = tw._split_params(tactic)
    w4 = tw.make_w4a16_linear(tactic)
    rope_write_kv = make_rope_write_kv(None)

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
        norm: NormIn | None = None,
    ) -> torch.Tensor:
        """`quant.reference.w4a16_qkv_rope_linear`'s contract: x [T, K] -> the rotated q
        [T, Hq, hd]; k and v written into the caches at slot_mapping (slots < 0 skipped).
        norm: x is the residual stream, RMSNorm-ed as it is loaded (gemm/fused_norm.py)."""
        w_args = (qweight, scales, pre_quant_scale, group_size, zeros, bias)
        if not fusable(x, *w_args, num_heads, num_kv_heads, dec, norm):
            nk = {"norm": norm} if norm is not None else {}

            def linear(x, qweight, bias):
                return w4(x, qweight, scales, pre_quant_scale, group_size, zeros, bias, **nk)

            return unfused_qkv_rope(
                linear, rope_write_kv, x, qweight, bias, positions, cos, sin, k_cache, v_cache,
                slot_mapping, num_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        T, N, kb = x.shape[0], qweight.shape[0], x.shape[1] // W4_BLOCK
        q, hd, strides = rope_output(x, N, num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                                     x.dtype, "w4a16_qkv_rope")  # fmt: skip
        bn, bg = int(dec["block_n"]), int(dec["block_g"])
        packed = bool(dec.get("packed", 0)) and x.dtype == torch.bfloat16
        fp8 = k_scale is not None and v_scale is not None
        pqs = pre_quant_scale
        _w4a16_qkv_rope_kernel[((num_heads + 2 * num_kv_heads) * (hd // bn),)](
            x, qweight, scales, pqs if pqs is not None else scales,
            bias if bias is not None else scales, positions, cos, sin, q, k_cache, v_cache,
            slot_mapping, k_scale if fp8 else None, v_scale if fp8 else None,
            T, N, kb, x.stride(0), tw._MAGIC, tw._MAGIC_BF16X2, tw._C136_BF16X2, *strides,
            HALF=hd // 2, BS=k_cache.shape[1], KV_FP8=fp8, HAS_PQS=pqs is not None,
            HAS_BIAS=bias is not None, BLOCKS_PER_GROUP=group_size // W4_BLOCK,
            BLOCK_M=triton.next_power_of_2(T), BLOCK_N=bn, BLOCK_G=bg, MASKED=kb % bg != 0,
            STAGES=int(dec.get("num_stages", 2)), PACKED=packed,
            num_warps=int(dec.get("num_warps", 4)), num_stages=1,
            **launch_options(), **norm_args(norm),
        )  # fmt: skip
        return q

    w4a16_qkv_rope_linear.gemv_rows = w4.gemv_rows
    return w4a16_qkv_rope_linear


# a w4a16_gemm tactic (GEMV half + GEMM half); the builder takes the attn.qkv w4a16_gemm choice
W4A16_QKV_ROPE_TACTICS: tuple[Tactic, ...] = tw.W4A16_TACTICS
