"""Every op the engine runs: a CPU reference per op, GPU kernels beside it, one registry."""

from __future__ import annotations

from .registry import PluginSpec, Tactic, all_specs, get_spec, load, register, target_kind

_P = "ingot.plugins"
_ACT = ("float32", "bfloat16", "float16")


def _op(
    name: str, fields: tuple[tuple[str, str], ...], cpu: str, cuda: str, tactics: str, version=1
) -> None:
    """One op: `cpu` and `cuda` name factories, `tactics` the cuda candidates."""
    register(
        PluginSpec(
            name,
            version,
            fields,
            _ACT,
            {"cpu": f"{_P}.{cpu}", "cuda": f"{_P}.{cuda}"},
            {"cuda": f"{_P}.{tactics}"},
        )
    )


# NOTE: bump a plugin's version whenever its semantics or its tensor layout changes; engines
# record (name, version) and refuse to load a version this ingot does not have.
_op(
    "embedding",
    (),
    "gemm.reference:make_embedding",
    "gemm.cuda:make_embedding",
    "gemm.cuda:EMBEDDING_TACTICS",
)
_op(
    "rms_norm",
    (("eps", "float32"),),
    "norm.reference:make_rms_norm",
    "norm.triton_kernels:make_rms_norm",
    "norm.triton_kernels:RMS_NORM_TACTICS",
)
_op(
    "add_rms_norm",
    (("eps", "float32"),),
    "norm.reference:make_add_rms_norm",
    "norm.triton_kernels:make_add_rms_norm",
    "norm.triton_kernels:RMS_NORM_TACTICS",
)
_op(
    "rope",
    (("kind", "str"), ("theta", "float32")),
    "rope.reference:make_rope",
    "rope.triton_kernels:make_rope",
    "rope.triton_kernels:ROPE_TACTICS",
)
_op(
    "rope_kv_write",
    (("kind", "str"), ("theta", "float32"), ("tokens_per_block", "int32")),
    "rope.reference:make_rope_write_kv",
    "rope.triton_kernels:make_rope_write_kv",
    "rope.triton_kernels:ROPE_TACTICS",
)
_op(
    "kv_cache_write",
    (("tokens_per_block", "int32"),),
    "attention.reference:make_write_kv",
    "attention.triton_kv_write:make_write_kv",
    "attention.triton_kv_write:KV_WRITE_TACTICS",
)
_op(
    "paged_attention",
    (
        ("num_heads", "int32"),
        ("num_kv_heads", "int32"),
        ("head_dim", "int32"),
        ("tokens_per_block", "int32"),
        ("sliding_window", "int32"),
    ),
    "attention.reference:make_paged_attention",
    "attention.triton_decode:make_paged_attention",
    "attention.triton_decode:PAGED_ATTENTION_TACTICS",
)
_op(
    "swiglu_gemm",
    (),
    "gemm.reference:make_swiglu_linear",
    "gemm.cuda:make_swiglu_linear",
    "gemm.cuda:GEMM_TACTICS",
)
_op("gemm", (), "gemm.reference:make_linear", "gemm.cuda:make_linear", "gemm.cuda:GEMM_TACTICS")
# the QKV projection with RoPE and the KV write in its epilogue (decode-sized batches)
_op(
    "qkv_rope_gemm",
    (("num_heads", "int32"), ("num_kv_heads", "int32"), ("tokens_per_block", "int32")),
    "gemm.reference:make_qkv_rope_linear",
    "gemm.qkv_rope:make_qkv_rope_linear",
    "gemm.qkv_rope:QKV_ROPE_TACTICS",
)
_op(
    "swiglu",
    (),
    "activation.reference:make_swiglu",
    "activation.triton_kernels:make_swiglu",
    "activation.triton_kernels:SWIGLU_TACTICS",
)
# Quantized GEMMs (layouts: docs/formats.md). FP8: Triton quantize + cuBLASLt (SM >= 89).
_op(
    "fp8_gemm",
    (),
    "quant.reference:make_fp8_linear",
    "quant.cuda_fp8:make_fp8_linear",
    "quant.cuda_fp8:FP8_GEMM_CANDIDATES",
)
# FP8 engines: the activation quantization fused into the op before each FP8 GEMM.
_op(
    "rms_norm_quant_fp8",
    (("eps", "float32"),),
    "quant.reference:make_rms_norm_quant_fp8",
    "quant.triton_quantize:make_rms_norm_quant_fp8",
    "quant.triton_quantize:QUANTIZE_TACTICS",
)
_op(
    "swiglu_quant_fp8",
    (),
    "quant.reference:make_swiglu_quant_fp8",
    "quant.triton_quantize:make_swiglu_quant_fp8",
    "quant.triton_quantize:QUANTIZE_TACTICS",
)
_op(
    "fp8_swiglu_gemm",
    (),
    "quant.reference:make_fp8_swiglu_linear",
    "quant.cuda_fp8:make_fp8_swiglu_linear",
    "quant.cuda_fp8:FP8_GEMM_TACTICS",
)
# FP8 engines: the FP8 QKV projection with RoPE and the KV write in its epilogue
_op(
    "fp8_qkv_rope_gemm",
    (("num_heads", "int32"), ("num_kv_heads", "int32"), ("tokens_per_block", "int32")),
    "quant.reference:make_fp8_qkv_rope_linear",
    "gemm.qkv_rope:make_fp8_qkv_rope_linear",
    "gemm.qkv_rope:FP8_QKV_ROPE_TACTICS",
)
_op(
    "w4a16_gemm",
    (("group_size", "int32"),),
    "quant.reference:make_w4a16_linear",
    "quant.triton_w4a16:make_w4a16_linear",
    "quant.w4a16_tactics:W4A16_TACTICS",
    version=2,  # v2: weights [N, K/8] interleaved per 128 k, scales [N, K/G] (v1: transposed)
)
# INT4 AWQ engines: the W4A16 QKV projection with RoPE and the KV write in its epilogue
_op(
    "w4a16_qkv_rope_gemm",
    (
        ("group_size", "int32"),
        ("num_heads", "int32"),
        ("num_kv_heads", "int32"),
        ("tokens_per_block", "int32"),
    ),
    "quant.reference:make_w4a16_qkv_rope_linear",
    "quant.w4a16_qkv_rope:make_w4a16_qkv_rope_linear",
    "quant.w4a16_qkv_rope:W4A16_QKV_ROPE_TACTICS",
)

__all__ = ["PluginSpec", "Tactic", "all_specs", "get_spec", "load", "register", "target_kind"]
