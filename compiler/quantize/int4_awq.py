"""INT4 AWQ (W4A16, symmetric, group size G) from ModelOpt's AWQ results.

ModelOpt's awq_lite leaves each linear with a smoothed weight W' and an activation scale s
(pre_quant_scale) such that (x * s) @ W'^T = x @ W^T, plus a per-group amax of W'. Codes are
q = clamp(round(W' / scale), -8, 7) with scale = amax / 7, stored as q + 8 (docs/formats.md).

Fused linears (qkv, gate_up) read one activation, so they need one s. When the parts' scales
differ, ingot takes their mean s_f, re-expresses each part as W' * s_part / s_f, and recomputes
each group's amax from that weight (the same max-calibration awq_lite uses).
"""

from __future__ import annotations

import torch

from ingot.plugins.quant.reference import INT4_ZERO, pack_int4

QMAX = 7


def group_amax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w: [N, K] -> max |w| per group [N, K/G]."""
    n, k = w.shape
    return w.abs().reshape(n, k // group_size, group_size).amax(dim=-1)


def int4_linear_tensors(
    weights: list[torch.Tensor],
    pre_quant_scales: list[torch.Tensor | None],
    amaxes: list[torch.Tensor],
    group_size: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Parts of one fused linear (smoothed weights [n_i, K] fp32, scales [K] or None, amax
    [n_i, K/G], all on one device) -> checkpoint tensors {"weight", "weight_scale",
    "pre_quant_scale"} on that device."""
    k = weights[0].shape[1]
    scales = [torch.ones(k, device=weights[0].device) if s is None else s.float()
              for s in pre_quant_scales]  # fmt: skip
    if all(torch.equal(s, scales[0]) for s in scales):
        s_f = scales[0]
        w = torch.cat(weights, dim=0)
        amax = torch.cat(
            [a.reshape(p.shape[0], -1) for a, p in zip(amaxes, weights, strict=True)], dim=0
        )
    else:
        s_f = torch.stack(scales).mean(dim=0)
        w = torch.cat([p * (s / s_f) for p, s in zip(weights, scales, strict=True)], dim=0)
        amax = group_amax(w, group_size)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)).to(dtype)  # [N, K/G]
    # NOTE: codes use the stored (rounded) scale, so dequantization reproduces them exactly.
    n = w.shape[0]
    groups = w.reshape(n, k // group_size, group_size) / scale.float()[..., None]
    q = torch.clamp(torch.round(groups), -QMAX - 1, QMAX).add_(INT4_ZERO)  # codes 0..15
    return {
        "weight": pack_int4(q.to(torch.uint8).reshape(n, k)),
        "weight_scale": scale,
        "pre_quant_scale": s_f.to(dtype),
    }
