"""A transformers model rebuilt from an engine's own weights, so the baseline runs exactly the
same weights without the source model dir.

The engine holds canonical names (docs/formats.md); this maps `ModelConfig` back to the
family's transformers config and unfuses q/k/v and gate/up (row slices: views, no copies).
Quantized engines cannot be rebuilt; they need the source model (`--hf-model-dir`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ingot.runtime.config import ModelConfig
from ingot.runtime.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(m: ModelConfig) -> Any:
    """The transformers config of `m`'s family (the inverse of model_config_from_hf)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}.get(
        m.family, Qwen3Config
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope.theta}
    if m.rope.kind == "llama3":
        rope.update(
            rope_type="llama3",
            factor=m.rope.factor,
            low_freq_factor=m.rope.low_freq_factor,
            high_freq_factor=m.rope.high_freq_factor,
            original_max_position_embeddings=m.rope.original_max_position_embeddings,
        )
    eos = list(m.eos_token_ids)
    kw: dict[str, Any] = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=m.tie_word_embeddings,
        bos_token_id=m.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        hidden_act="silu",
        dtype=m.dtype,
    )
    if m.family == "mistral":
        kw["sliding_window"] = m.sliding_window
    elif m.family in ("qwen2", "qwen3"):
        kw.update(
            use_sliding_window=m.sliding_window is not None,
            sliding_window=m.sliding_window,
            max_window_layers=0,
        )
    if m.family in ("llama", "qwen3"):
        kw["attention_bias"] = False
    cfg = cls(**kw)
    cfg.architectures = [m.architecture]
    return cfg


def hf_state_dict(weights: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical engine weights -> transformers names (q/k/v and gate/up unfused)."""
    sd = {"model.embed_tokens.weight": weights["embed.weight"]}
    sd["model.norm.weight"] = weights["final_norm.weight"]
    if "lm_head.weight" in weights:
        sd["lm_head.weight"] = weights["lm_head.weight"]
    sizes = [m.q_size, m.kv_size, m.kv_size]
    for i in range(m.num_layers):
        c, h = f"layers.{i}.", f"model.layers.{i}."
        sd[h + "input_layernorm.weight"] = weights[c + "attn_norm.weight"]
        sd[h + "post_attention_layernorm.weight"] = weights[c + "mlp_norm.weight"]
        sd[h + "self_attn.o_proj.weight"] = weights[c + "attn.o.weight"]
        sd[h + "mlp.down_proj.weight"] = weights[c + "mlp.down.weight"]
        q, k, v = weights[c + "attn.qkv.weight"].split(sizes, dim=0)
        sd |= {h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k}
        sd[h + "self_attn.v_proj.weight"] = v
        if m.qkv_bias:
            qb, kb, vb = weights[c + "attn.qkv.bias"].split(sizes, dim=0)
            sd |= {h + "self_attn.q_proj.bias": qb, h + "self_attn.k_proj.bias": kb}
            sd[h + "self_attn.v_proj.bias"] = vb
        if m.qk_norm:
            sd[h + "self_attn.q_norm.weight"] = weights[c + "attn.q_norm.weight"]
            sd[h + "self_attn.k_norm.weight"] = weights[c + "attn.k_norm.weight"]
        gate, up = weights[c + "mlp.gate_up.weight"].split(m.intermediate_size, dim=0)
        sd |= {h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up}
    return sd


def model_from_engine(
    weights: Mapping[str, torch.Tensor], m: ModelConfig, quant_mode: str, device: torch.device
) -> Any:
    """An eval-mode transformers model on `device` holding the engine's weights. Built on
    `meta` and assigned (no random init); the RoPE buffers are recomputed on `device`."""
    from transformers import AutoModelForCausalLM

    if quant_mode != "none":
        raise ConfigError(
            f"the engine is quantized ({quant_mode}); the baseline cannot be rebuilt from it",
            "pass --hf-model-dir with the source model",
        )
    cfg = hf_config(m)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=_DTYPES[m.dtype])
    sd = {n: t.to(device) for n, t in hf_state_dict(weights, m).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [n for n in missing if not (n == "lm_head.weight" and m.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(
            f"cannot rebuild the HF model: missing {missing[:3]}, unexpected {unexpected[:3]}",
            "pass --hf-model-dir with the source model",
        )
    if m.tie_word_embeddings:
        model.tie_weights()
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ConfigError(f"cannot rebuild the HF model: {meta[:3]} have no data")
    return _ready(model)


_SOURCE_HINT = "pass the Hugging Face model dir the engine was converted from"


def check_hf_dir(hf_dir: Path, m: ModelConfig) -> None:
    """ConfigError unless --hf-model-dir holds a Hugging Face model of the engine's
    architecture; checked before ingot's own run (a baseline of another model compares
    nothing)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--hf-model-dir {hf_dir} has no config.json", _SOURCE_HINT)
    try:
        archs = json.loads(path.read_text()).get("architectures") or [None]
    except (ValueError, AttributeError):
        raise ConfigError(f"{path} is not a JSON object", _SOURCE_HINT) from None
    if archs[0] != m.architecture:
        what = archs[0] or "no Hugging Face model (its config.json names no architecture)"
        raise ConfigError(
            f"--hf-model-dir {hf_dir} holds {what}, the engine {m.architecture}", _SOURCE_HINT
        )


def model_from_dir(hf_dir: Path, m: ModelConfig, device: torch.device) -> Any:
    """The source model, loaded by transformers in the engine's dtype (`hf_dir` passed
    `check_hf_dir` before ingot's run)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=_DTYPES[m.dtype])
    except (OSError, ValueError, SafetensorError) as e:  # missing or truncated weights, say
        raise ConfigError(f"transformers cannot load --hf-model-dir {hf_dir}: {e}") from None
    return _ready(model.to(device))


def _ready(model: Any) -> Any:
    model.eval()
    model.generation_config.eos_token_id = None  # run every request to its full length
    return model
