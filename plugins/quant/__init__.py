"""Quantized GEMM plugins (FP8 W8A8, INT4 AWQ W4A16): CPU references now, GPU kernels later."""

from __future__ import annotations

# Quantization mode -> the GEMM plugin its linears run through (the other ops are shared).
GEMM_PLUGIN_OF_MODE = {"fp8": "fp8_gemm", "int4_awq": "w4a16_gemm"}


def unused_plugins(mode: str) -> set[str]:
    """Quantized GEMM plugins an engine of quantization `mode` does not run."""
    return {p for m, p in GEMM_PLUGIN_OF_MODE.items() if m != mode}
