"""Dense GEMM (y = x W^T + b) and the token embedding, plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, K], weight: [N, K], bias: [N] | None -> [T, N]."""
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids: [T] -> weight rows [T, D]."""
    return F.embedding(ids.long(), weight)


def swiglu_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """gate_up: [T, 2I] (gate, then up), weight: [N, I] -> linear(silu(gate) * up, weight)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight, bias)


def make_swiglu_linear(tactic=None):
    return swiglu_linear


def make_linear(tactic=None):
    return linear


def make_embedding(tactic=None):
    return embedding


def unfused_qkv_rope(
    linear_fn, rope_write_kv_fn, x, weight, bias, positions, cos, sin, k_cache, v_cache,
    slot_mapping, num_heads: int, num_kv_heads: int, *, k_scale=None, v_scale=None,
) -> torch.Tensor:  # fmt: skip
    """`qkv_rope_linear` as its two ops: linear_fn(x, weight, bias) -> [T, (Hq + 2 Hkv) hd],
    split into heads, then rope_write_kv_fn (the references here; the GPU plugins for the fused
    kernel's fallback and its tests)."""
    T = x.shape[0]
    hd = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    q, k, v = linear_fn(x, weight, bias).split(
        [num_heads * hd, num_kv_heads * hd, num_kv_heads * hd], dim=-1
    )
    return rope_write_kv_fn(
        q.reshape(T, num_heads, hd), k.reshape(T, num_kv_heads, hd),
        v.reshape(T, num_kv_heads, hd), positions, cos, sin, k_cache, v_cache, slot_mapping,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def qkv_rope_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The QKV projection, then RoPE and the KV-cache write (`rope.reference.rope_write_kv`):
    x [T, K], weight [(Hq + 2 Hkv) hd, K] -> the rotated q [T, Hq, hd]; k and v go into the
    caches at slot_mapping."""
    from ingot.plugins.rope.reference import rope_write_kv

    return unfused_qkv_rope(
        linear, rope_write_kv, x, weight, bias, positions, cos, sin, k_cache, v_cache,
        slot_mapping, num_heads, num_kv_heads, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def make_qkv_rope_linear(tactic=None):
    return qkv_rope_linear
