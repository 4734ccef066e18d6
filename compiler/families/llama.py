"""Llama 2, Llama 3/3.1 (llama3 RoPE scaling), Llama 3.2 (tied embeddings)."""

from __future__ import annotations

from typing import Any

from . import Family, no_biases


def _switches(hf: dict[str, Any]) -> dict[str, Any]:
    no_biases(hf, "llama")
    return {"qkv_bias": False, "qk_norm": False, "sliding_window": None}


FAMILY = Family(name="llama", architectures=("LlamaForCausalLM",), config_switches=_switches)
