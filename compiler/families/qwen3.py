"""Qwen3 (dense): the Llama layout plus per-head RMSNorm on q and k, and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from . import Family, no_biases, qwen_sliding_window


def _switches(hf: dict[str, Any]) -> dict[str, Any]:
    no_biases(hf, "qwen3")
    return {"qkv_bias": False, "qk_norm": True, "sliding_window": qwen_sliding_window(hf)}


FAMILY = Family(name="qwen3", architectures=("Qwen3ForCausalLM",), config_switches=_switches)
