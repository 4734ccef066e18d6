"""Every op the engine runs: a CPU reference per op, GPU kernels beside it, one registry."""

from __future__ import annotations

from .registry import PluginSpec, Tactic, all_specs, get_spec, load, register, target_kind

_P = "ingot.plugins"

# NOTE: bump a plugin's version whenever its semantics or its tensor layout changes; engines
# record (name, version) and refuse to load a version this ingot does not have.
register(
    PluginSpec(
        "embedding",
        1,
        (),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.gemm.reference:make_embedding"},
    )
)
register(
    PluginSpec(
        "rms_norm",
        1,
        (("eps", "float32"),),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.norm.reference:make_rms_norm"},
    )
)
register(
    PluginSpec(
        "add_rms_norm",
        1,
        (("eps", "float32"),),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.norm.reference:make_add_rms_norm"},
    )
)
register(
    PluginSpec(
        "rope",
        1,
        (("kind", "str"), ("theta", "float32")),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.rope.reference:make_rope"},
    )
)
register(
    PluginSpec(
        "kv_cache_write",
        1,
        (("tokens_per_block", "int32"),),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.attention.reference:make_write_kv"},
    )
)
register(
    PluginSpec(
        "paged_attention",
        1,
        (
            ("num_heads", "int32"),
            ("num_kv_heads", "int32"),
            ("head_dim", "int32"),
            ("tokens_per_block", "int32"),
            ("sliding_window", "int32"),
        ),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.attention.reference:make_paged_attention"},
    )
)
register(
    PluginSpec(
        "gemm",
        1,
        (),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.gemm.reference:make_linear"},
    )
)
register(
    PluginSpec(
        "swiglu",
        1,
        (),
        ("float32", "bfloat16", "float16"),
        {"cpu": f"{_P}.activation.reference:make_swiglu"},
    )
)

__all__ = ["PluginSpec", "Tactic", "all_specs", "get_spec", "load", "register", "target_kind"]
