"""ModelOpt's calibrated HF model -> ingot checkpoint tensors (docs/formats.md layout).

For each quantizable canonical linear, its HF parts (q/k/v, gate/up, or one) are read from the
QuantLinear modules in canonical row order, and fp8.py / int4_awq.py make the stored tensors.
KV-cache scales come from each attention's k_bmm_quantizer / v_bmm_quantizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ingot.runtime.config import ModelConfig, QuantConfig
from ingot.runtime.errors import ConfigError

from .fp8 import fp8_linear_tensors, scale_of
from .int4_awq import int4_linear_tensors
from .layout import LINEARS

Progress = Callable[[str, int, int], None]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _amax(quantizer: Any, what: str) -> torch.Tensor:
    amax = getattr(quantizer, "amax", None) if quantizer is not None else None
    if amax is None:
        raise ConfigError(
            f"ModelOpt left no calibrated amax for {what}",
            "check the calibration text reaches every layer (raise --calib-size)",
        )
    return amax.detach().float().cpu()


def _modules(model: Any, sources: tuple[str, ...]) -> list[tuple[str, Any]]:
    return [(s[: -len(".weight")], model.get_submodule(s[: -len(".weight")])) for s in sources]


def _linear(
    model: Any, sources: tuple[str, ...], quant: QuantConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    # NOTE: each linear is quantized where the calibrated model lives (the GPU for --device
    # cuda) and only its results come to the host: done on the host, from fp32 copies of the
    # weights, the export took 44 s of an 8B INT4 convert's 240 (H200 machine, 2026-12-05)
    mods = _modules(model, sources)
    if quant.mode == "fp8":
        return _on_host(_fp8(mods))
    weights = [m.weight.detach().float() for _, m in mods]
    dev = weights[0].device
    pqs = []
    for _, m in mods:
        s = getattr(m.input_quantizer, "pre_quant_scale", None)
        pqs.append(None if s is None else s.detach().float().to(dev))
    amax = [_amax(m.weight_quantizer, f"{n} weight").to(dev) for n, m in mods]
    return _on_host(int4_linear_tensors(weights, pqs, amax, quant.group_size, dtype))


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.cpu() for k, t in tensors.items()}


def _fp8(mods: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    return fp8_linear_tensors(
        [m.weight.detach().float() for _, m in mods],
        [float(_amax(m.weight_quantizer, f"{n} weight")) for n, m in mods],
        [float(_amax(m.input_quantizer, f"{n} input")) for n, m in mods],
    )


def _fp8_lm_head(model: Any, out: dict[str, torch.Tensor]) -> None:
    """The FP8 lm_head (a tied one gets its own copy; the embedding stays as it was). In an
    INT4 AWQ run ModelOpt smooths it too (x * pre_quant_scale before its input quantizer): the
    final norm, its only reader, takes the scale into its weight."""
    mods = _modules(model, ("lm_head.weight",))
    for key, t in _on_host(_fp8(mods)).items():
        out["lm_head." + key] = t
    pqs = getattr(mods[0][1].input_quantizer, "pre_quant_scale", None)
    if pqs is not None:
        w = out["final_norm.weight"]
        out["final_norm.weight"] = (w.float() * pqs.detach().float().cpu()).to(w.dtype)


def export_tensors(
    model: Any,
    cfg: ModelConfig,
    quant: QuantConfig,
    tensors: dict[str, torch.Tensor],
    plan: dict[str, tuple[str, ...]],
    progress: Progress,
) -> dict[str, torch.Tensor]:
    """Unquantized canonical tensors + the calibrated model -> the quantized checkpoint's."""
    out = dict(tensors)
    dtype = _DTYPES[cfg.dtype]
    attn = [m for n, m in model.named_modules() if hasattr(m, "k_bmm_quantizer")]
    for i in range(cfg.num_layers):
        progress("quantizing", i, cfg.num_layers)
        if quant.mode != "none":
            for name in LINEARS:
                prefix = f"layers.{i}.{name}."
                for key, t in _linear(model, plan[prefix + "weight"], quant, dtype).items():
                    out[prefix + key] = t
        if quant.kv_cache_dtype == "fp8":
            a = attn[i]
            out[f"layers.{i}.attn.k_scale"] = scale_of(float(_amax(a.k_bmm_quantizer, "K")))
            out[f"layers.{i}.attn.v_scale"] = scale_of(float(_amax(a.v_bmm_quantizer, "V")))
    if quant.lm_head:
        _fp8_lm_head(model, out)
    progress("quantizing", cfg.num_layers, cfg.num_layers)
    return out
