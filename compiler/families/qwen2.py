"""Qwen2 / Qwen2.5: the Llama layout plus q/k/v biases; sliding window only if enabled."""

from __future__ import annotations

from typing import Any

from . import Family, qwen_sliding_window


def _switches(hf: dict[str, Any]) -> dict[str, Any]:
    # NOTE: Qwen2 always has q/k/v biases and never an o_proj bias (no `attention_bias` key).
    return {"qkv_bias": True, "qk_norm": False, "sliding_window": qwen_sliding_window(hf)}


FAMILY = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), config_switches=_switches)
