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


def make_linear(tactic=None):
    return linear


def make_embedding(tactic=None):
    return embedding
