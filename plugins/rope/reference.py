"""Rotary position embedding (rotate-half / NeoX layout, as Hugging Face Llama), plain torch."""

from __future__ import annotations

import math

import torch


def inv_freq(
    head_dim: int,
    theta: float,
    kind: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32.

    kind "llama3": Llama 3.1 scaling — long wavelengths are divided by `factor`, short ones kept,
    and the band between is interpolated smoothly.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    freqs = 1.0 / (theta**exponents)
    if kind == "default":
        return freqs
    if kind != "llama3":
        raise ValueError(f"unsupported rope kind {kind!r}")
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_cache(freqs: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim] float32, halves repeated (rotate-half layout)."""
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, hd], k: [T, Hkv, hd], positions: [T] -> rotated (q, k) in their dtype."""
    c = cos[positions.long()].to(q.dtype)[:, None, :]  # [T, 1, hd]
    s = sin[positions.long()].to(q.dtype)[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def make_rope(tactic=None):
    return apply_rope


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    v_rows: int | None = None,
    runs: int = 0,
) -> torch.Tensor:
    """RoPE on q and k, then k and v into the paged cache at `slot_mapping` (an FP8 cache:
    quantized with k_scale / v_scale, as `write_kv`); returns the rotated q [T, Hq, hd]. The
    fused GPU kernel saves a launch and a pass over k. v_rows: V of the first v_rows tokens
    only (the decode rows' V goes to paged_attention's new_v). runs: how many leading tokens
    are prompt tokens (a layout hint for the GPU kernel; nothing here depends on it)."""
    from ingot.plugins.attention.reference import write_cache

    q, k = apply_rope(q, k, positions, cos, sin)
    t = k.shape[0] if v_rows is None else int(v_rows)
    fp8 = k_scale is not None and v_scale is not None
    write_cache(k, k_cache, slot_mapping, k_scale if fp8 else None)
    write_cache(v[:t], v_cache, slot_mapping[:t], v_scale if fp8 else None)
    if q_out is None:
        return q
    q_out.copy_(q)
    return q_out


def make_rope_write_kv(tactic=None):
    return rope_write_kv
