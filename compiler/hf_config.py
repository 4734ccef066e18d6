"""The one function that reads a Hugging Face config.json (STYLE.md principle 2)."""

from __future__ import annotations

from typing import Any

from ingot.runtime.config import DTYPES, ModelConfig, RopeConfig
from ingot.runtime.errors import CheckpointError, ConfigError

from .families import family_for_architecture

ROPE_KINDS = ("default", "llama3")
DTYPE_CHOICES = ("auto", *DTYPES)
# HF spells a few dtypes the torch way; normalise before validating.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def resolve_dtype(dtype: str, hf_config: dict[str, Any]) -> str:
    """`auto` takes the config's `dtype` (transformers 5) or `torch_dtype`, default bfloat16."""
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(
            f"unknown dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_CHOICES)}"
        )
    if dtype != "auto":
        return dtype
    found = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    found = _DTYPE_ALIASES.get(str(found), str(found)).removeprefix("torch.")
    if found not in DTYPES:
        raise ConfigError(
            f"config.json has dtype {found!r}, which ingot cannot convert to",
            hint=f"pass --dtype with one of {', '.join(DTYPES)}",
        )
    return found


def _rope(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(
            "per-layer-type RoPE parameters are not supported",
            hint=f"supported RoPE types: {', '.join(ROPE_KINDS)}",
        )
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        try:
            return RopeConfig(
                theta=theta,
                kind="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise CheckpointError(
                f"llama3 RoPE scaling in config.json lacks {e.args[0]!r}"
            ) from None
    raise CheckpointError(
        f"RoPE type {kind!r} is not supported",
        hint=f"supported RoPE types: {', '.join(ROPE_KINDS)}",
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise CheckpointError(
            f"config.json lacks {key!r}", hint="is this a complete Hugging Face config?"
        )
    return hf[key]


def model_config_from_hf(hf_config: dict[str, Any], dtype: str = "auto") -> ModelConfig:
    """Map an HF config.json dict to a ModelConfig.

    Raises CheckpointError for unsupported architectures, RoPE types or features, and
    ConfigError for an unknown dtype.
    """
    archs = hf_config.get("architectures") or [None]
    arch = archs[0]
    family = family_for_architecture(arch)
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"hidden_act {act!r} is not supported", hint="ingot supports silu (SwiGLU)"
        )
    hidden = int(_require(hf_config, "hidden_size"))
    heads = int(_require(hf_config, "num_attention_heads"))
    return ModelConfig(
        architecture=arch,
        family=family.name,
        vocab_size=int(_require(hf_config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(hf_config, "intermediate_size")),
        num_layers=int(_require(hf_config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
        # NOTE: Mistral configs may carry head_dim: null; Qwen3's head_dim != hidden/heads.
        head_dim=int(hf_config.get("head_dim") or hidden // heads),
        max_position_embeddings=int(_require(hf_config, "max_position_embeddings")),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope=_rope(hf_config),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        dtype=resolve_dtype(dtype, hf_config),
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf_config.get("eos_token_id")),
        **family.config_switches(hf_config),
    )
