"""SwiGLU on a fused gate/up projection, plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first, then up) -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_swiglu(tactic=None):
    return swiglu
