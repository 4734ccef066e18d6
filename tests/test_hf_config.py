"""model_config_from_hf: the one reader of HF config.json."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from ingot.compiler.hf_config import model_config_from_hf
from ingot.runtime.errors import CheckpointError, ConfigError

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
CLASSES = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}


def hf_dict(family: str, **kw: Any) -> dict[str, Any]:
    """A config.json dict as transformers 5 writes it."""
    cls, arch = CLASSES[family]
    d = cls(**{**TINY, **kw}).to_dict()
    d["architectures"] = [arch]
    return d


def legacy_llama(**kw: Any) -> dict[str, Any]:
    """A config.json as transformers 4 wrote it (rope_theta + rope_scaling, torch_dtype)."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008],
        **TINY,
    }
    d.update(kw)
    return d


@pytest.mark.parametrize("family", list(CLASSES))
def test_families_map(family: str) -> None:
    cfg = model_config_from_hf(
        hf_dict(family, head_dim=32) if family == "qwen3" else hf_dict(family)
    )
    assert cfg.family == family and cfg.architecture == CLASSES[family][1]
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2, 4, 2)
    assert cfg.head_dim == (32 if family == "qwen3" else 16)
    assert cfg.qkv_bias == (family == "qwen2")
    assert cfg.qk_norm == (family == "qwen3")
    assert cfg.rope.kind == "default" and cfg.rope.theta == 10000.0


def test_llama3_rope_parameters_v5() -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    cfg = model_config_from_hf(hf_dict("llama", rope_parameters=rope))
    assert cfg.rope.kind == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 32.0
    assert cfg.rope.original_max_position_embeddings == 128


def test_llama3_rope_scaling_legacy() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = model_config_from_hf(legacy_llama(rope_scaling=scaling, tie_word_embeddings=True))
    assert cfg.rope.kind == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.rope.original_max_position_embeddings == 8192
    assert cfg.tie_word_embeddings
    assert cfg.dtype == "bfloat16" and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 128000 and cfg.eos_token_ids == (128001, 128008)


def test_legacy_default_rope_keeps_theta() -> None:
    cfg = model_config_from_hf(legacy_llama())
    assert cfg.rope.kind == "default" and cfg.rope.theta == 500000.0


@pytest.mark.parametrize(
    "rope", [{"type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}]
)
def test_unsupported_rope_type(rope: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError) as e:
        model_config_from_hf(legacy_llama(rope_scaling=rope))
    kind = rope.get("rope_type", rope.get("type"))
    assert kind in e.value.message and "llama3" in e.value.one_line()


def test_unsupported_architecture_lists_supported() -> None:
    d = hf_dict("llama")
    d["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(CheckpointError) as e:
        model_config_from_hf(d)
    line = e.value.one_line()
    assert "GPT2LMHeadModel" in line
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in line


def test_missing_architectures() -> None:
    d = hf_dict("llama")
    del d["architectures"]
    with pytest.raises(CheckpointError, match="names no architecture") as e:
        model_config_from_hf(d)
    assert "build-engine --checkpoint-dir" in e.value.one_line()  # an ingot checkpoint given?


@pytest.mark.parametrize(
    ("config_dtype", "key", "want"),
    [
        ("float16", "torch_dtype", "float16"),
        ("float32", "dtype", "float32"),
        (None, "dtype", "bfloat16"),
        ("torch.float16", "torch_dtype", "float16"),
    ],
)
def test_dtype_auto(config_dtype: str | None, key: str, want: str) -> None:
    d = legacy_llama()
    d.pop("torch_dtype")
    d[key] = config_dtype
    assert model_config_from_hf(d).dtype == want
    assert model_config_from_hf(d, dtype="float32").dtype == "float32"


def test_bad_dtype() -> None:
    with pytest.raises(ConfigError, match="int8"):
        model_config_from_hf(legacy_llama(), dtype="int8")
    with pytest.raises(ConfigError, match="float8"):
        model_config_from_hf(legacy_llama(torch_dtype="float8_e4m3fn"))


@pytest.mark.parametrize(("eos", "want"), [(2, (2,)), ([2, 7], (2, 7)), (None, ())])
def test_eos_int_or_list(eos: Any, want: tuple[int, ...]) -> None:
    assert model_config_from_hf(legacy_llama(eos_token_id=eos)).eos_token_ids == want


def test_mistral_sliding_window() -> None:
    assert model_config_from_hf(hf_dict("mistral", sliding_window=None)).sliding_window is None
    assert model_config_from_hf(hf_dict("mistral", sliding_window=4096)).sliding_window == 4096
    d = hf_dict("mistral")
    d["head_dim"] = None  # some Mistral configs write head_dim: null
    assert model_config_from_hf(d).head_dim == 16


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_honours_use_sliding_window(family: str) -> None:
    legacy = {**hf_dict(family), "sliding_window": 4096, "max_window_layers": 28}
    legacy.pop("layer_types")
    legacy["use_sliding_window"] = False
    assert model_config_from_hf(legacy).sliding_window is None
    legacy["use_sliding_window"] = True  # max_window_layers 28 >= 2 layers: all full attention
    assert model_config_from_hf(legacy).sliding_window is None
    legacy["max_window_layers"] = 0
    assert model_config_from_hf(legacy).sliding_window == 4096
    legacy["max_window_layers"] = 1
    with pytest.raises(CheckpointError, match="mixes sliding-window"):
        model_config_from_hf(legacy)
    v5 = hf_dict(family, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert model_config_from_hf(v5).sliding_window == 64


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_bias_unsupported(family: str) -> None:
    with pytest.raises(CheckpointError, match="attention_bias"):
        model_config_from_hf(hf_dict(family, attention_bias=True))


def test_missing_required_key_and_activation() -> None:
    d = legacy_llama()
    del d["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        model_config_from_hf(d)
    with pytest.raises(CheckpointError, match="gelu"):
        model_config_from_hf(legacy_llama(hidden_act="gelu"))
