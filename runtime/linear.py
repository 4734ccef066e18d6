"""Linear layers of an engine, bound once at load: plain GEMM, or a quantized plugin.

A quantization mode adds a branch to `make_linear` (and its plugins), never a model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import QuantConfig

Linear = Callable[[torch.Tensor], torch.Tensor]


def make_linear(ops, weights: dict[str, torch.Tensor], prefix: str, quant: QuantConfig) -> Linear:
    """The callable computing `prefix` (e.g. "layers.0.attn.qkv"): x [T, K] -> [T, N]."""
    weight = weights[prefix + ".weight"]
    bias = weights.get(prefix + ".bias")
    site = prefix.split(".", 2)[-1]  # "layers.3.attn.qkv" -> "attn.qkv"
    if quant.mode == "none":
        gemm = ops.at("gemm", site)
        return lambda x: gemm(x, weight, bias)
    raise NotImplementedError(f"quantization mode {quant.mode!r} has no linear implementation yet")
