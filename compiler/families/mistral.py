"""Mistral: the Llama layout plus an optional sliding window on every layer (may be null)."""

from __future__ import annotations

from typing import Any

from . import Family, no_biases


def _switches(hf: dict[str, Any]) -> dict[str, Any]:
    no_biases(hf, "mistral")
    window = hf.get("sliding_window")
    return {
        "qkv_bias": False,
        "qk_norm": False,
        "sliding_window": None if window is None else int(window),
    }


FAMILY = Family(name="mistral", architectures=("MistralForCausalLM",), config_switches=_switches)
