"""Dense GEMM (y = x W^T + b) and the token embedding, plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K], bias: [N] | None -> [T, N]."""
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids: [T] -> weight rows [T, D]."""
    return F.embedding(ids.long(), weight)


def swiglu_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """gate_up: [T, 2I] (gate, then up), weight: [N, I] -> linear(silu(gate) * up, weight)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight, bias)


def make_swiglu_linear(tactic=None):
    return swiglu_linear


def make_linear(tactic=None):
    return linear


def make_embedding(tactic=None):
    return embedding
