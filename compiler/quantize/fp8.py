"""FP8 (W8A8, static per-tensor scales) from ModelOpt's calibrated amax values.

scale = amax / 448 (the e4m3 range), as ModelOpt's fake quantization uses. Fused linears (qkv,
gate_up) share one weight scale: the largest of their parts', and every part is re-quantized
with it, so no part saturates.
"""

from __future__ import annotations

import torch

from ingot.plugins.quant.reference import FP8_MAX, quantize_fp8

_TINY = 1e-12  # amax floor: an all-zero tensor still gets a usable scale


def scale_of(amax: float) -> torch.Tensor:
    return torch.tensor(max(amax, _TINY) / FP8_MAX, dtype=torch.float32)


def fp8_linear_tensors(
    weights: list[torch.Tensor], weight_amax: list[float], input_amax: list[float]
) -> dict[str, torch.Tensor]:
    """Parts of one fused linear (weights [n_i, K] fp32, rows in canonical order) -> the
    checkpoint tensors {"weight", "weight_scale", "input_scale"} (names without the prefix)."""
    w_scale = scale_of(max(weight_amax))
    in_scale = scale_of(max(input_amax))
    w = torch.cat(weights, dim=0)  # [N, K], on the weights' device
    return {"weight": quantize_fp8(w, w_scale.to(w.device)), "weight_scale": w_scale,
            "input_scale": in_scale}  # fmt: skip
