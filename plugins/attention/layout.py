"""Paged KV-cache layouts, shared by the cache writers, the attention kernels and the pool.

Every layer's caches are seen as [num_blocks, block_size, Hkv, hd]. K is stored that way
(head dim contiguous, blocks contiguous). V is stored either the same way or, for FP8 caches,
*transposed*: each block holds [Hkv, hd, block_size] (tokens contiguous), seen through a
permuted view of the same logical shape (strides (bs*Hkv*hd, 1, hd*bs, bs)).

Why: attention's P.V product needs V with the summed dimension (tokens) contiguous in pairs.
Triton on sm_90 has no transposing 8-bit shared-memory load, so an FP8 V stored token-major
was read from shared memory a byte at a time (~1.6x the loop instructions of the transposed
layout, sm_90 SASS); BF16 V uses a 16-bit transposing load and stays token-major.
"""

from __future__ import annotations

import torch

# Decode launches bounded by at most SHORT_CONTEXT keys run a tactic's short-context decode
# tactic (triton_decode.py), and the decode graphs of small batches are captured at this bound
# too (runtime/cuda_graphs.py): here, where both read it without Triton.
SHORT_CONTEXT = 512

TRANSPOSE_V_DTYPES = (torch.float8_e4m3fn,)


def transposes_v(dtype: torch.dtype) -> bool:
    """Whether a pool of this dtype stores V transposed."""
    return dtype in TRANSPOSE_V_DTYPES


def transposed_view(storage: torch.Tensor) -> torch.Tensor:
    """[nb, Hkv, hd, bs] storage -> its [nb, bs, Hkv, hd] view."""
    return storage.permute(0, 3, 1, 2)


def v_like(k_cache: torch.Tensor, transposed: bool | None = None) -> torch.Tensor:
    """A zero V cache for `k_cache` ([nb, bs, Hkv, hd]) in the layout its dtype uses
    (`transposed` overrides)."""
    transposed = transposes_v(k_cache.dtype) if transposed is None else transposed
    if not transposed:
        return k_cache.new_zeros(k_cache.shape)  # NOTE: not zeros_like, which keeps strides
    nb, bs, h, hd = k_cache.shape
    return transposed_view(k_cache.new_zeros(nb, h, hd, bs))


def to_v_layout(v_cache: torch.Tensor, transposed: bool | None = None) -> torch.Tensor:
    """The same values as `v_cache` ([nb, bs, Hkv, hd]) in the layout its dtype uses."""
    out = v_like(v_cache, transposed)
    out.copy_(v_cache)
    return out


def is_transposed(v_cache: torch.Tensor) -> bool:
    nb, bs, h, hd = v_cache.shape
    return v_cache.stride() == (bs * h * hd, 1, hd * bs, bs)


def check_kv_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, who: str) -> bool:
    """Raise ValueError unless K is [nb, bs, Hkv, hd] (hd contiguous, blocks contiguous) and V
    has K's shape and either K's strides or the transposed layout. Returns whether V is
    transposed."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{who}: k/v caches must both be [num_blocks, block_size, Hkv, hd], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    bs = k_cache.shape[1]
    if k_cache.stride(-1) != 1 or k_cache.stride(0) != bs * k_cache.stride(1):
        raise ValueError(f"{who}: the K cache must have blocks and head_dim contiguous")
    if is_transposed(v_cache):
        return True
    if v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"{who}: the V cache must share K's layout or be transposed per block "
            "(plugins/attention/layout.py)"
        )
    return False
