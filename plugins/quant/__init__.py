"""Quantized plugins (FP8 W8A8, INT4 AWQ W4A16): CPU references and GPU kernels."""

from __future__ import annotations

# Quantization mode -> the GEMM plugin its linears run through (the other ops are shared).
GEMM_PLUGIN_OF_MODE = {"fp8": "fp8_gemm", "int4_awq": "w4a16_gemm"}


# FP8 engines quantize activations inside the op before each FP8 GEMM (norm or SwiGLU).
FP8_FUSED_PLUGINS = (
    "rms_norm_quant_fp8",
    "swiglu_quant_fp8",
    "fp8_swiglu_gemm",
    "fp8_qkv_rope_gemm",
)


# INT4 AWQ engines: the QKV GEMV with RoPE in its epilogue.
INT4_FUSED_PLUGINS = ("w4a16_qkv_rope_gemm",)


def unused_plugins(mode: str, lm_head: bool = False) -> set[str]:
    """Quantized plugins an engine of quantization `mode` does not run (`lm_head`: its lm_head
    is FP8, so fp8_gemm runs whatever the mode)."""
    unused = {
        p for m, p in GEMM_PLUGIN_OF_MODE.items() if m != mode and not (lm_head and m == "fp8")
    }
    unused |= set() if mode == "fp8" else set(FP8_FUSED_PLUGINS)
    return unused | (set() if mode == "int4_awq" else set(INT4_FUSED_PLUGINS))
