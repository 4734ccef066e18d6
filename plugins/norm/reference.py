"""RMSNorm, plain torch. Computes in float32 and casts back, as Hugging Face Llama/Qwen do."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x.dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm. Returns (norm(residual + x), residual + x), both [T, D]."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual


def make_rms_norm(tactic=None):
    return rms_norm


def make_add_rms_norm(tactic=None):
    return add_rms_norm
