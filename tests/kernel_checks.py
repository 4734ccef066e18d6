"""What every kernel test compares: relative error against a reference (NaN anywhere, e.g. an
unwritten element of a poisoned output, fails at once) and bit equality of FP8 tensors."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or bad masking)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both float8_e4m3fn with identical bytes."""
    f8 = torch.float8_e4m3fn
    return a.dtype == b.dtype == f8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp8_hard_values() -> torch.Tensor:
    """Every finite fp8 value, the midpoints between neighbours (ties) and their fp32
    neighbours, subnormals, values past 448, and plain random data (float32, on the CPU)."""
    f8 = torch.float8_e4m3fn
    grid = torch.arange(256, dtype=torch.uint8).view(f8).float()
    grid = grid[~grid.isnan()].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    rnd = torch.cat([torch.randn(500) * 100, torch.randn(300) * 1e-3, torch.randn(200) * 1e3])
    return torch.cat([grid, mids, up, down, rnd, torch.tensor([-0.0, 0.0, 500.0, -1e6])])


def rope_fp8_write_fused_vs_unfused(q, k, v, pos, cos, sin, slots, scales, cache_shape):
    """RoPE fused with the FP8 KV write against RoPE then the FP8 KV write (the GPU kernels):
    asserts equal q and equal cache bits; returns (rotated q, k cache, v cache) of the fused."""
    from ingot.plugins.attention import triton_kv_write as kvw
    from ingot.plugins.attention.layout import v_like
    from ingot.plugins.rope import triton_kernels as rope_gpu

    f8 = torch.float8_e4m3fn
    k_caches = [torch.zeros(cache_shape, device=q.device, dtype=f8) for _ in range(2)]
    # V in the layout an FP8 pool uses (transposed per block)
    caches = [k_caches[0], v_like(k_caches[0]), k_caches[1], v_like(k_caches[1])]
    fused_q = rope_gpu.make_rope_write_kv(None)(
        q, k, v, pos, cos, sin, caches[0], caches[1], slots, **scales
    )
    q2, k2 = rope_gpu.make_rope(None)(q, k, pos, cos, sin)
    kvw.make_write_kv(None)(k2, v, caches[2], caches[3], slots, **scales)
    assert torch.equal(fused_q, q2)
    assert same_bits(caches[0], caches[2]) and same_bits(caches[1], caches[3])
    return fused_q, caches[0], caches[1]


def new_v_stored_by_attention(fn, q, kc, vc, bt, cl, qsl, scale, kw):
    """paged_attention with new_v (the decode rows' V, stored by the kernel) against the
    reference storing the same V first and the kernel attending without it: equal V caches
    (bits: the segment stored around each new token keeps its other bytes) and outputs equal
    but for summation order (the kernel takes the newest key's tile first), far closer than
    attending to the cache without the new V.
    kw: the call's metadata (max_query_len, num_decodes, ...) and an FP8 cache's scales."""
    from ingot.plugins.attention import reference as attn_ref

    n = attn_ref.decode_rows(q.shape[0], cl.shape[0], kw["max_query_len"], kw.get("num_decodes", 0))
    assert n > 0
    new_v = torch.randn(n, kc.shape[2], kc.shape[3], device=q.device, dtype=q.dtype)
    vc_ref = vc.clone() if vc.stride() == kc.stride() else _same_layout_copy(vc)
    attn_ref.write_decode_v(new_v, vc_ref, bt, cl, kw.get("v_scale"))
    assert not torch.equal(vc_ref.view(torch.uint8), vc.view(torch.uint8)), "nothing to store"
    want = fn(q, kc, vc_ref, bt, cl, qsl, scale, **kw)
    stale = fn(q, kc, vc, bt, cl, qsl, scale, **kw)
    got = fn(q, kc, vc, bt, cl, qsl, scale, new_v=new_v, **kw)
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    err = rel_err(got.float(), want.float())
    assert err < 5e-3 and err < 0.1 * rel_err(stale.float(), want.float()), err


def _same_layout_copy(v_cache: torch.Tensor) -> torch.Tensor:
    """A copy of a transposed V cache that keeps its strides (clone() would make it dense)."""
    from ingot.plugins.attention.layout import to_v_layout

    return to_v_layout(v_cache, transposed=True)
