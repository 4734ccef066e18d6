"""Model families: a name map (HF -> canonical) and a config mapping each, no model code.

All four supported families share the Llama-style HF layout, so the base map lives here and a
family file only adds its extra tensors and its config switches (DESIGN.md decision 1).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ingot.runtime.errors import CheckpointError

# canonical name (per layer, without "layers.{i}.") -> HF names (without "model.layers.{i}.").
# NOTE: more than one source means fused: sources are concatenated along dim 0 in this order.
BASE_LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.o.weight": ("self_attn.o_proj.weight",),
    "mlp_norm.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
QKV_BIAS_TENSORS: dict[str, tuple[str, ...]] = {
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
QK_NORM_TENSORS: dict[str, tuple[str, ...]] = {
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
}
GLOBAL_TENSORS: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
HF_LAYER_PREFIX = "model.layers.{i}."

# HF checkpoints sometimes carry buffers that are recomputed at run time; skip them silently.
IGNORED_HF_TENSORS = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)


@dataclass(frozen=True)
class Family:
    """One model family. `config_switches(hf)` returns the ModelConfig fields it decides."""

    name: str
    architectures: tuple[str, ...]
    config_switches: Callable[[dict[str, Any]], dict[str, Any]]
    extra_layer_tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def layer_tensors(self, *, qkv_bias: bool, qk_norm: bool) -> dict[str, tuple[str, ...]]:
        """Canonical -> HF sources for one layer, for a config with these switches."""
        out = dict(BASE_LAYER_TENSORS)
        if qkv_bias:
            out.update(QKV_BIAS_TENSORS)
        if qk_norm:
            out.update(QK_NORM_TENSORS)
        out.update(self.extra_layer_tensors)
        return out


def no_biases(hf: dict[str, Any], family: str) -> None:
    """Llama-style `attention_bias`/`mlp_bias` also add o_proj/MLP biases, which ingot lacks."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise CheckpointError(
                f"{family} config sets {key}=true, which ingot does not support",
                hint="only Qwen2's q/k/v biases are supported",
            )


def qwen_sliding_window(hf: dict[str, Any]) -> int | None:
    """Qwen2/3: the window applies only with use_sliding_window, and only from max_window_layers."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or window is None:
        return None
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise CheckpointError(
        "config mixes sliding-window and full-attention layers, which ingot does not support",
        hint="set use_sliding_window=false or max_window_layers=0 in config.json",
    )


def _registry() -> dict[str, Family]:
    from . import llama, mistral, qwen2, qwen3

    return {f.name: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}


FAMILIES: dict[str, Family] = _registry()
ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.architectures}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def family_for_architecture(arch: str | None) -> Family:
    """The family for an HF `architectures[0]`; CheckpointError listing the supported ones."""
    if arch is None:
        raise CheckpointError(
            "config.json names no architecture (no `architectures` list)",
            hint="point --model-dir at a Hugging Face model directory; an ingot checkpoint "
            "goes to build-engine --checkpoint-dir",
        )
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {arch!r}; ingot supports "
            f"{', '.join(supported_architectures())}",
            hint="check `architectures` in config.json",
        )
    return ARCHITECTURES[arch]


def get_family(name: str) -> Family:
    return FAMILIES[name]
