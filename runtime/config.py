"""Frozen, validated configs shared by the compiler and the runtime.

Exactly one function reads a Hugging Face config (`ingot.compiler.hf_config.model_config_from_hf`);
everything after it speaks `ModelConfig`. Configs round-trip through plain dicts (JSON).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
QUANT_MODES = ("none", "fp8", "int4_awq")
KV_CACHE_DTYPES = ("auto", "fp8")


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ConfigError(f"invalid config: {what}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding. `kind` is "default" or "llama3" (Llama 3.1 frequency scaling)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _require(self.theta > 0, f"rope theta must be > 0, got {self.theta}")
        _require(self.kind in ("default", "llama3"), f"rope kind {self.kind!r} is not supported")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only graph with small switches (DESIGN.md decision 1)."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require(self.family in FAMILIES, f"family {self.family!r} not in {FAMILIES}")
        _require(self.dtype in DTYPES, f"dtype {self.dtype!r} not in {DTYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}",
        )
        _require(
            self.sliding_window is None or self.sliding_window > 0, "sliding_window must be > 0"
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        try:
            d["rope"] = RopeConfig(**d.get("rope", {}))
            d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"model config does not match this ingot version: {e}") from None


@dataclass(frozen=True)
class QuantConfig:
    """Quantization recorded in checkpoints and engines. `mode` "none" means plain weights."""

    mode: str = "none"
    kv_cache_dtype: str = "auto"
    group_size: int = 128
    # the lm_head quantized too, to FP8 (fp8 and int4_awq modes; by default it stays in the
    # model dtype)
    lm_head: bool = False

    def __post_init__(self) -> None:
        _require(self.mode in QUANT_MODES, f"quant mode {self.mode!r} not in {QUANT_MODES}")
        _require(
            not self.lm_head or self.mode in ("fp8", "int4_awq"),
            "a quantized lm_head needs mode fp8 or int4_awq",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv cache dtype {self.kv_cache_dtype!r} not in {KV_CACHE_DTYPES}",
        )
        _require(self.group_size > 0, "group_size must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        return cls(**d)


def pdl_capable(target: str) -> bool:
    """Whether `target` ('cpu', 'sm_XY') has programmatic dependent launch (SM 90+)."""
    return target.startswith("sm_") and target[3:].isdigit() and int(target[3:]) >= 90


@dataclass(frozen=True)
class BuildConfig:
    """Limits an engine is built for. Flags override presets, presets override these defaults."""

    max_batch_size: int = 64
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    tokens_per_block: int = 16
    target: str = "cpu"
    # programmatic dependent launch between the forward pass's Triton kernels (plugins/pdl.py)
    # in small decode batches (runtime/model.py: Decoder.uses_pdl); build-engine turns it on
    # for engines with unquantized weights on sm_90+ targets unless told otherwise
    # (compiler/build.py: resolve_build_config)
    pdl: bool = False
    # RMSNorm folded into the decode GEMVs of small batches (plugins/gemm/fused_norm.py): the
    # GEMV before a norm adds into the residual stream, the one after normalizes as it loads
    # x; no norm kernels between them. Off unless asked for (not yet timed on a GPU).
    fused_norms: bool = False
    # FP8 GEMMs (cuBLASLt) accumulate in the tensor cores alone, without promoting partial
    # sums to full fp32 (plugins/quant/cuda_fp8.py), on the rows a build on the GPU timed it
    # faster (compiler/fast_accum.py; a cross-build: from 512 rows): faster
    # prefill and large-batch steps, less exact over long K; the accuracy report (made at
    # convert time on the reference path) does not see it. Off unless asked for.
    fp8_fast_accum: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "tokens_per_block"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        _require(
            self.target == "cpu" or self.target.startswith("sm_"),
            f"target {self.target!r} must be 'cpu' or like 'sm_90'",
        )
        for name in ("pdl", "fused_norms", "fp8_fast_accum"):
            v = getattr(self, name)
            _require(isinstance(v, bool), f"{name} must be true or false, got {v!r}")
        _require(
            not self.fused_norms or self.target != "cpu",
            "fused_norms folds the norms into the GPU GEMV kernels: it needs a GPU target",
        )
        _require(
            not self.fp8_fast_accum or self.target != "cpu",
            "fp8_fast_accum changes cuBLASLt's FP8 GEMMs: it needs a GPU target",
        )
        _require(
            not self.pdl or pdl_capable(self.target),
            f"pdl needs an sm_90 or newer target (programmatic dependent launch), "
            f"not {self.target!r}",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildConfig:
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"build config does not match this ingot version: {e}") from None
