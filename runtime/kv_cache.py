"""The paged KV pool: one tensor [L, 2, num_blocks, tokens_per_block, Hkv, hd] on the device.

The C++ core owns which block belongs to whom; this owns the memory. An FP8 pool stores each
block's V transposed ([Hkv, hd, tokens_per_block]; plugins/attention/layout.py).
"""

from __future__ import annotations

import math

import torch

from ingot.plugins.attention.layout import transposed_view, transposes_v

from .config import ModelConfig
from .errors import ConfigError


class KVCache:
    """`num_blocks` blocks for the scheduler plus one scratch block (index num_blocks) that
    padded rows of a captured decode graph write to and read from. tp: each rank holds its
    num_kv_heads / tp heads."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        tokens_per_block: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: int = 1,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        # NOTE: zero-filled so that padded block-table entries (block 0) read finite values;
        # one block more than the scheduler's: the scratch block.
        shape = (cfg.num_layers, 2, num_blocks + 1, tokens_per_block, cfg.num_kv_heads // tp,
                 cfg.head_dim)  # fmt: skip
        try:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError too
            if "alloc" not in str(e) and "out of memory" not in str(e):
                raise
            gib = math.prod(shape) * dtype.itemsize / 2**30
            gpu = device.type == "cuda"
            raise ConfigError(
                f"the KV cache of {num_blocks:,} blocks ({gib:,.1f} GiB) does not fit in "
                f"{'GPU' if gpu else 'host'} memory",
                "lower --num-kv-blocks"
                + (" or --kv-cache-free-gpu-memory-fraction" if gpu else ""),
            ) from None
        self.transposed_v = transposes_v(dtype)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i: each seen as [num_blocks, tokens_per_block, Hkv, hd]
        (V a permuted view when the pool stores it transposed)."""
        k, v = self.data[i, 0], self.data[i, 1]
        if self.transposed_v:
            nb, bs, h, hd = v.shape
            v = transposed_view(v.view(nb, h, hd, bs))
        return k, v

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
