"""FP8 W8A8 GEMM on CUDA (plugin fp8_gemm v1): same contract as `reference.fp8_linear`.

Decode-sized x (at most a GEMV tactic's `max_m` rows) goes to the GEMV kernel of
`gemm/cuda.py` with FP8 operands: a batch-1 step is a pure weight stream, and cuBLASLt's FP8
GEMM at M = 1 reached 59% of the bandwidth roofline on the H200 (302 tok/s for the
Llama-3.1-8B shape, whose FP8 weights allow ~510). Larger x:

x is quantized by a small Triton kernel (`triton_quantize`, bit-exact with the reference), then
multiplied by cuBLASLt through `torch._scaled_mm` with the static per-tensor scales: fp8 x fp8
products accumulated in fp32, scaled by input_scale * weight_scale, bias added, one cast to the
output dtype. The engine's weight [N, K] row-major is the column-major B `_scaled_mm` wants.
A tactic with `fast_accum` (engines built with --fp8-fast-accum) lets cuBLASLt accumulate in
the tensor cores alone, without promoting partial sums to full fp32 every few K steps
(cuBLASLt's fast-accumulation mode), for x of the rows in `fast_accum_rows` (timed per GEMM
by a build on the GPU, `compiler/fast_accum.py`; from FAST_ACCUM_MIN_ROWS in a cross-built
engine): faster there, less exact over long K.

cuBLASLt's FP8 GEMM needs SM >= 89, K and N multiples of 16 and 16-byte aligned operands;
other shapes take a fallback in the same call: the fp8 operands upcast to fp32 and multiplied by
torch (products of fp8 values are exact, so only the accumulation order differs). A bias that
`_scaled_mm` cannot fuse (fp32 output, or another dtype) is added in fp32 afterwards.
"""

from __future__ import annotations

import os

import torch

from ..gemm.cuda import gemv_ok, gemv_rows, gemv_tactic, launch_gemv
from ..gemm.fused_norm import AddOut, NormIn, add_output, normed_input
from ..registry import Tactic
from .reference import fp8_matmul, fp8_operand
from .row_room import in_ranges, padded_rows, row_ranges, with_rows
from .triton_quantize import QUANTIZE_TACTICS, quantize_fp8

# A cuBLASLt tactic is the quantize kernel's configuration (cuBLASLt picks its own algorithm);
# a GEMV tactic is the GEMV kernel's (16 fp8 per 16-byte load: block_k >= 512 * num_warps),
# with cuBLASLt past its max_m rows. First (a cuBLASLt one): the default of the fused SwiGLU
# down projection when cross-building without a GPU, i.e. unfused (`fp8_swiglu_gemm`).
FP8_GEMM_TACTICS: tuple[Tactic, ...] = tuple(
    Tactic("cublaslt_q" + t.name, t.params) for t in QUANTIZE_TACTICS
) + (
    gemv_tactic(2, 4096, 8, 1, max_m=1),
    gemv_tactic(4, 2048, 4, 1, unroll=2, max_m=2),
    gemv_tactic(2, 2048, 4, 1, unroll=2, max_m=1),
    gemv_tactic(8, 2048, 4, 1, max_m=4),
    gemv_tactic(4, 4096, 8, 2, max_m=2),
)
# NOTE: H100, Llama-3.1-8B layer GEMMs (scripts/bench_batch_decode.py --gemms-only, two runs):
# fast accumulation took 10% off at 8,192 rows and 6.4% at 512, ~2% at 128, but cuBLASLt's
# fast-accumulation pick for gate_up at 448 rows ran 34% slower (162 vs 121 us). A build on the
# GPU times it per GEMM instead (`fast_accum_rows`); this is a cross-built engine's floor.
FAST_ACCUM_MIN_ROWS = 512
PAD_ROWS_ENV = "INGOT_PAD_ROWS"


def fast_accum_tactic(t: Tactic, rows: str | None = None) -> Tactic:
    """`t` with fast accumulation on (what build-engine --fp8-fast-accum records), on `rows`
    ("lo-hi" ranges, comma-separated; "lo-" open-ended; None: from FAST_ACCUM_MIN_ROWS)."""
    where = () if rows is None else (("fast_accum_rows", rows),)
    return Tactic(t.name, t.params + (("fast_accum", 1),) + where)


# fp8_gemm's candidates, first its cross-build default: the GEMV fastest at every Llama-8B
# site at batch 1 on the H200 (2026-12-04, 8-35% ahead of cuBLASLt) and within 2% of the
# fastest on the H100 (2026-12-05 evening, 14-30% ahead); larger batches run cuBLASLt
_DEFAULT_GEMV = gemv_tactic(2, 2048, 4, 1, unroll=2, max_m=1)
FP8_GEMM_CANDIDATES: tuple[Tactic, ...] = (_DEFAULT_GEMV,) + tuple(
    t for t in FP8_GEMM_TACTICS if t != _DEFAULT_GEMV
)


def _scaled_mm_ok(xq: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    K = xq.shape[1]
    N = weight.shape[0]
    return (
        xq.device.type in ("cuda", "meta")  # meta: the AOT dry run records the quantize launch
        and K % 16 == 0
        and N % 16 == 0
        and weight.stride(1) == 1
        and weight.stride(0) % 16 == 0
        and xq.stride(1) == 1
        and xq.stride(0) % 16 == 0
        and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def make_fp8_linear(tactic: Tactic | None = None):
    params = tactic.as_dict() if tactic is not None else {}
    max_m = int(params.get("max_m", 0))  # 0: cuBLASLt only
    # no ranges: fp32 promotion everywhere
    fast_rows = (
        row_ranges(params.get("fast_accum_rows", f"{FAST_ACCUM_MIN_ROWS}-"))
        if params.get("fast_accum")
        else []
    )

    # rows that run on padded_rows(rows) (`row_room`; a build on the GPU timed them faster);
    # INGOT_PAD_ROWS=0 runs them unpadded, for A/Bs on one engine
    padding = "pad_rows" in params and os.environ.get(PAD_ROWS_ENV) != "0"
    pad_rows = row_ranges(params["pad_rows"]) if padding else []

    def fast_at(rows: int) -> bool:
        return in_ranges(fast_rows, rows)

    qtactic = None if max_m else (tactic or FP8_GEMM_TACTICS[0])

    def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return quantize_fp8(x, scale, tactic=qtactic)

    def fp8_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        out_dtype: torch.dtype | None = None,
        norm: NormIn | None = None,
        add: AddOut | None = None,
    ) -> torch.Tensor:
        """x: [T, K] (model dtype, or float8_e4m3fn already quantized with input_scale by a
        fused producer; then pass out_dtype), weight: [N, K] fp8, scales float32 [] -> [T, N].
        norm / add: the RMSNorm folded in (gemm/fused_norm.py; x the residual stream with
        `norm`, quantized after the norm; `add` returns the residual)."""
        scales = (input_scale, weight_scale)
        if norm is not None or add is not None:
            out_dtype = out_dtype or x.dtype
            out = add.residual if add is not None else None
            if max_m and gemv_ok(x, weight, bias, out, max_m, out_dtype=out_dtype, norm=norm):
                return launch_gemv(x, weight, bias, None, params, False, scales, out_dtype,
                                   norm=norm, add=add)  # fmt: skip
            x = normed_input(x, norm) if norm is not None else x
            y = fp8_linear(x, weight, weight_scale, input_scale, bias, out_dtype=out_dtype)
            return add_output(y, add) if add is not None else y
        xq, out_dtype = fp8_operand(x, input_scale, out_dtype, quantize)
        if max_m and gemv_ok(xq, weight, bias, None, max_m, out_dtype=out_dtype):
            return launch_gemv(xq, weight, bias, None, params, False, scales, out_dtype)
        if not _scaled_mm_ok(xq, weight, out_dtype):
            return fp8_matmul(xq, weight, weight_scale, input_scale, bias, out_dtype)
        # NOTE: _scaled_mm takes a bias only in the output's dtype (and none for fp32 output).
        fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
        rows = xq.shape[0]
        if in_ranges(pad_rows, rows):
            xq = with_rows(xq, padded_rows(rows))
        y = torch._scaled_mm(
            xq,
            weight.t(),
            scale_a=input_scale,
            scale_b=weight_scale,
            bias=bias if fused_bias else None,
            out_dtype=torch.float32 if bias is not None and not fused_bias else out_dtype,
            use_fast_accum=fast_at(xq.shape[0]),
        )
        if bias is not None and not fused_bias:
            y = (y + bias.float()).to(out_dtype)
        return y[:rows]

    fp8_linear.gemv_rows = gemv_rows(max_m)  # batches whose norms may be folded in
    return fp8_linear


def make_fp8_swiglu_linear(tactic: Tactic | None = None):
    """SwiGLU + quantize folded into the FP8 down projection (`reference.fp8_swiglu_linear`):
    for decode-sized T a GEMV tactic computes silu(gate) * up and quantizes it as it loads x,
    saving the SwiGLU-quantize launch; otherwise that kernel, then `fp8_gemm`."""
    from .triton_quantize import make_swiglu_quant_fp8

    params = tactic.as_dict() if tactic is not None else {}
    max_m = int(params.get("max_m", 0))
    swiglu_q = make_swiglu_quant_fp8(None)
    linear = make_fp8_linear(tactic)

    def fp8_swiglu_linear(
        gate_up: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        out_dtype: torch.dtype | None = None,
        add: AddOut | None = None,
    ) -> torch.Tensor:
        """add: the output added into the residual stream (gemm/fused_norm.py), returned."""
        out_dtype = out_dtype or gate_up.dtype
        out = add.residual if add is not None else None
        if max_m and gemv_ok(gate_up, weight, bias, out, max_m, True, out_dtype):
            scales = (input_scale, weight_scale)
            return launch_gemv(gate_up, weight, bias, None, params, True, scales, out_dtype,
                               add=add)  # fmt: skip
        act = swiglu_q(gate_up, input_scale)
        y = linear(act, weight, weight_scale, input_scale, bias, out_dtype=out_dtype)
        return add_output(y, add) if add is not None else y

    fp8_swiglu_linear.gemv_rows = linear.gemv_rows
    return fp8_swiglu_linear
