"""Where quantized tensors live: the checkpoint layout (docs/formats.md) and the engine repack.

Checkpoint (written by convert-checkpoint), per quantized linear X:
  fp8:      X.weight float8_e4m3fn [N, K], X.weight_scale float32 [], X.input_scale float32 []
  int4_awq: X.weight int32 [N, K/8] (codes q+8, low nibble first along K),
            X.weight_scale [N, K/G] and X.pre_quant_scale [K] in the model dtype
  kv fp8:   layers.{i}.attn.k_scale / v_scale float32 []
  lm_head (fp8 with --quant-lm-head): lm_head.weight / weight_scale / input_scale as above,
            also for tied embeddings (embed.weight stays in the model dtype)
Engine (written by build-engine): fp8 unchanged ([N, K] row-major is the column-major B that
`torch._scaled_mm` takes as weight.t()); int4 X.weight stays [N, K/8] with its codes
interleaved within each block of 128 k, X.weight_scale [N, K/G] unchanged (plugin w4a16_gemm
v2, see plugins/quant/reference.py).
"""

from __future__ import annotations

import torch

from ingot.plugins.quant.reference import pack_w4_engine, unpack_int4
from ingot.runtime.config import ModelConfig, QuantConfig

LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
_ST = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # safetensors dtype names


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Quantizable linear -> (N, K) of its weight [N, K]."""
    return {
        "attn.qkv": (cfg.qkv_size, cfg.hidden_size),
        "attn.o": (cfg.hidden_size, cfg.q_size),
        "mlp.gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "mlp.down": (cfg.hidden_size, cfg.intermediate_size),
    }


def checkpoint_layout(cfg: ModelConfig, quant: QuantConfig) -> dict[str, tuple[tuple, str]]:
    """Name -> (shape, safetensors dtype) of every tensor quantization adds or changes."""
    out: dict[str, tuple[tuple, str]] = {}
    act, g = _ST[cfg.dtype], quant.group_size
    for i in range(cfg.num_layers):
        for name, (n, k) in linear_shapes(cfg).items():
            p = f"layers.{i}.{name}."
            if quant.mode == "fp8":
                out[p + "weight"] = ((n, k), "F8_E4M3")
                out[p + "weight_scale"] = ((), "F32")
                out[p + "input_scale"] = ((), "F32")
            elif quant.mode == "int4_awq":
                out[p + "weight"] = ((n, k // 8), "I32")
                out[p + "weight_scale"] = ((n, k // g), act)
                out[p + "pre_quant_scale"] = ((k,), act)
        if quant.kv_cache_dtype == "fp8":
            out[f"layers.{i}.attn.k_scale"] = ((), "F32")
            out[f"layers.{i}.attn.v_scale"] = ((), "F32")
    if quant.lm_head:
        out["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), "F8_E4M3")
        out["lm_head.weight_scale"] = ((), "F32")
        out["lm_head.input_scale"] = ((), "F32")
    return out


def repack_for_engine(quant: QuantConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """One checkpoint tensor -> its engine layout (most tensors pass through unchanged)."""
    if quant.mode == "int4_awq" and name.endswith(".weight") and name.startswith("layers."):
        site = name.split(".", 2)[-1].rsplit(".", 1)[0]  # "layers.0.attn.o.weight" -> "attn.o"
        if site in LINEARS:
            return pack_w4_engine(unpack_int4(t, torch.uint8))  # k order -> interleaved per 128 k
    return t.contiguous()
