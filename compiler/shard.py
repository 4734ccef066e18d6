"""Tensor-parallel sharding of a checkpoint's tensors (docs/formats.md, "Tensor parallelism").

Rank r of tp gets: QKV column-parallel by head, fused as [q_r; k_r; v_r] (its Hq/tp q heads,
its Hkv/tp kv heads, the bias split like the rows); gate/up column-parallel by rows, fused as
[gate_r; up_r]; O and down row-parallel (their input columns split the same way); the
embedding and lm_head vocabulary-parallel (rows r*V'/tp.., V' = V rounded up to a multiple of
tp, padding rows zero); norms and q/k norms replicated.
"""

from __future__ import annotations

import torch

from ingot.runtime.config import ModelConfig
from ingot.runtime.distributed import check_tp, padded_vocab

__all__ = ["check_tp", "padded_vocab", "shard_tensor", "shard_tensors"]


def _split_rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank] if tp > 1 else t


def shard_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of canonical tensor `name` (unquantized)."""
    if tp == 1:
        return t
    linear = name.split(".", 2)[-1].rsplit(".", 1)[0] if name.startswith("layers.") else name
    if linear == "attn.qkv":  # weight [(Hq + 2Hkv) hd, D] or bias [(Hq + 2Hkv) hd]
        q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
        return torch.cat([_split_rows(x, tp, rank) for x in (q, k, v)], dim=0)
    if linear == "mlp.gate_up":  # [2I, D]
        gate, up = t.split([cfg.intermediate_size, cfg.intermediate_size], dim=0)
        return torch.cat([_split_rows(gate, tp, rank), _split_rows(up, tp, rank)], dim=0)
    if linear in ("attn.o", "mlp.down"):  # [D, Hq hd] / [D, I]: input columns
        return t.chunk(tp, dim=1)[rank]
    if name in ("embed.weight", "lm_head.weight"):  # [V, D]
        pad = padded_vocab(t.shape[0], tp) - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])], dim=0)
        return t.chunk(tp, dim=0)[rank]
    return t  # norms, q/k norms: replicated


def shard_tensors(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], tp: int
) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors (views where possible; the writer makes them contiguous)."""
    check_tp(cfg, tp)
    return [{n: shard_tensor(cfg, n, t, tp, r) for n, t in tensors.items()} for r in range(tp)]
