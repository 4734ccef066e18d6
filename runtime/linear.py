"""Linear layers of an engine, bound once at load: plain GEMM, or a quantized plugin.

A quantization mode adds a branch to `make_linear` (and its plugins), never a model.
Quantized weights arrive in the engine layout build-engine repacked them into (docs/formats.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import QuantConfig

Linear = Callable[..., torch.Tensor]


def make_linear(
    ops,
    weights: dict[str, torch.Tensor],
    prefix: str,
    quant: QuantConfig,
    out_dtype: torch.dtype | None = None,
) -> Linear:
    """The callable computing `prefix` (e.g. "layers.0.attn.qkv"): x [T, K] -> [T, N].
    FP8: x may arrive already quantized (fp8 from a fused norm / SwiGLU); the output is then
    `out_dtype` (the model dtype). All take `norm=` / `add=`, a norm folded in
    (plugins/gemm/fused_norm.py); INT4 ones `gated=True` too (SwiGLU inside)."""
    weight = weights[prefix + ".weight"]
    bias = weights.get(prefix + ".bias")
    site = prefix.split(".", 2)[-1]  # "layers.3.attn.qkv" -> "attn.qkv"
    if quant.mode == "none":
        gemm = ops.at("gemm", site)
        return lambda x, **folded: gemm(x, weight, bias, **folded)
    if quant.mode == "fp8":
        fp8 = ops.at("fp8_gemm", site)
        w_scale, in_scale = weights[prefix + ".weight_scale"], weights[prefix + ".input_scale"]
        return lambda x, **folded: fp8(
            x, weight, w_scale, in_scale, bias, out_dtype=out_dtype, **folded
        )
    if quant.mode == "int4_awq":
        w4 = ops.at("w4a16_gemm", site)
        scales = weights[prefix + ".weight_scale"]  # [N, K/G]
        zeros = weights.get(prefix + ".weight_zero")
        pqs = weights.get(prefix + ".pre_quant_scale")  # [K]
        g = quant.group_size
        # gated=True: x is [gate | up] and SwiGLU runs inside the plugin (the down projection)
        return lambda x, **kw: w4(x, weight, scales, pqs, g, zeros, bias, **kw)
    raise NotImplementedError(f"quantization mode {quant.mode!r} has no linear implementation yet")
