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


def _qkv_rope_case(T, heads, kv_heads, hd, kv_dtype, bias, dtype, device, K):
    """Inputs of a QKV-RoPE check: x, w, b, positions, cos, sin, slots, the FP8 cache's
    scales, and a function giving fresh caches (K filled with 0.25, V with 0.5)."""
    from ingot.plugins.attention.layout import v_like
    from ingot.plugins.rope import reference as rope_ref

    gen = torch.Generator().manual_seed(T * 7 + hd + K)
    bs, n_pos = 16, 300
    N = (heads + 2 * kv_heads) * hd

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x, w = rnd(T, K), rnd(N, K, scale=K**-0.5)
    b = rnd(N) if bias else None
    freqs = rope_ref.inv_freq(hd, 10000.0)
    cos, sin = (t.to(device) for t in rope_ref.cos_sin_cache(freqs, n_pos))
    pos = torch.randint(0, n_pos, (T,), generator=gen, dtype=torch.int32).to(device)
    # NOTE: not the last slot, where the reference's write of a slot -1 lands
    slots = torch.randperm(4 * bs - 1, generator=gen)[:T].to(torch.int32).to(device)
    if T > 1:
        slots[1] = -1  # a padding token: nothing written
    scales = {}
    if kv_dtype == torch.float8_e4m3fn:
        one = torch.tensor(0.05, device=device)
        scales = {"k_scale": one, "v_scale": one * 0.5}

    def caches():
        k = torch.full((4, bs, kv_heads, hd), 0.25, device=device).to(kv_dtype)
        v = v_like(k)
        v.fill_(0.5)
        return k, v

    return x, w, b, pos, cos, sin, slots, scales, caches


def _compare_qkv_rope_runs(runs, slots, exact, device, bs=16):
    """runs: name -> (q, k cache, v cache) of "fused", "unfused" and "reference": fused and
    unfused the same bits (exact) or within rounding, both near the reference; slots not
    written keep their fill."""
    fq, fk, fv = runs["fused"]
    uq, uk, uv = runs["unfused"]
    if exact:
        assert torch.equal(fq, uq), (fq.float() - uq.float()).abs().max()
        for a, b in ((fk, uk), (fv, uv)):
            assert same_bits(a, b) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)
    else:  # the same sums; the rotation's rounding may differ by an ulp
        assert rel_err(fq.float(), uq.float()) < 5e-3
        for a, b in ((fk, uk), (fv, uv)):
            assert rel_err(a.float(), b.float()) < 2e-2
    rq, rk, rv = runs["reference"]
    assert rel_err(fq.float(), rq.float()) < 2e-2
    written = slots[slots >= 0].long()
    n_slots = fk.shape[0] * bs
    for got, want, fill in ((fk, rk, 0.25), (fv, rv, 0.5)):
        g, r = got.float(), want.float()
        assert rel_err(g[written // bs, written % bs], r[written // bs, written % bs]) < 6e-2
        untouched = torch.ones(n_slots, dtype=torch.bool, device=device)
        untouched[written] = False
        gu = g.reshape(n_slots, -1)[untouched]
        assert torch.equal(gu, torch.full_like(gu, fill))


def qkv_rope_fused_vs_unfused(
    tactic, T, heads, kv_heads, hd, kv_dtype, bias=False, exact=True, dtype=torch.bfloat16,
    device="cpu", K=192,
):  # fmt: skip
    """The QKV GEMV with RoPE + KV write in its epilogue against the GEMV then the RoPE + KV
    write kernel (same tactic), and against the CPU reference within bf16 tolerance: q, the
    K/V caches (slots written, a padding slot -1 skipped, all else untouched). exact: the
    same bits (the interpreter; on the GPU the compiler may contract differently)."""
    from ingot.plugins.gemm import qkv_rope
    from ingot.plugins.gemm import reference as gemm_ref
    from ingot.plugins.gemm.cuda import make_linear
    from ingot.plugins.rope.triton_kernels import make_rope_write_kv

    x, w, b, pos, cos, sin, slots, scales, caches = _qkv_rope_case(
        T, heads, kv_heads, hd, kv_dtype, bias, dtype, device, K
    )
    runs = {}
    for name, fn in (
        ("fused", qkv_rope.make_qkv_rope_linear(tactic)),
        ("reference", gemm_ref.make_qkv_rope_linear(None)),
    ):
        kc, vc = caches()
        q = fn(x, w, b, pos, cos, sin, kc, vc, slots, heads, kv_heads, **scales)
        runs[name] = (q, kc, vc)
    assert qkv_rope.fusable(x, w, b, heads, kv_heads, tactic.as_dict())
    # unfused: the GEMV of the same tactic, then the RoPE + KV write kernel
    kc, vc = caches()
    q = gemm_ref.unfused_qkv_rope(
        make_linear(tactic), make_rope_write_kv(None), x, w, b, pos, cos, sin, kc, vc, slots,
        heads, kv_heads, **scales,
    )  # fmt: skip
    runs["unfused"] = (q, kc, vc)
    _compare_qkv_rope_runs(runs, slots, exact, device)
    return runs


def fp8_qkv_rope_fused_vs_unfused(
    tactic, T, heads, kv_heads, hd, kv_dtype, bias=False, exact=True, dtype=torch.bfloat16,
    device="cpu", K=192,
):  # fmt: skip
    """`qkv_rope_fused_vs_unfused` with FP8 weights and x quantized before (a norm-quantize
    kernel's output; plugin fp8_qkv_rope_gemm): the fused kernel against the FP8 GEMV of
    the same tactic then the RoPE + KV write kernel, and against the reference
    (`quant.reference.fp8_qkv_rope_linear`). x in the model dtype, normed and quantized as
    it is loaded: `fused_norm_checks.qkv_rope_norm_in`."""
    from ingot.plugins.gemm import qkv_rope
    from ingot.plugins.gemm.reference import unfused_qkv_rope
    from ingot.plugins.quant import reference as qref
    from ingot.plugins.quant.cuda_fp8 import make_fp8_linear
    from ingot.plugins.rope.triton_kernels import make_rope_write_kv

    x, w, b, pos, cos, sin, slots, scales, caches = _qkv_rope_case(
        T, heads, kv_heads, hd, kv_dtype, bias, dtype, device, K
    )
    f32 = dict(dtype=torch.float32, device=device)
    ws = w.float().abs().max() / qref.FP8_MAX
    xs = x.float().abs().max() / qref.FP8_MAX
    wq = qref.quantize_fp8(w.float(), ws)
    xq = qref.quantize_fp8(x.float(), xs)
    ws, xs = ws.to(**f32), xs.to(**f32)
    args = (xq, wq, ws, xs, b, pos, cos, sin)
    runs = {}
    for name, fn in (
        ("fused", qkv_rope.make_fp8_qkv_rope_linear(tactic)),
        ("reference", qref.make_fp8_qkv_rope_linear(None)),
    ):
        kc, vc = caches()
        q = fn(*args, kc, vc, slots, heads, kv_heads, out_dtype=dtype, **scales)
        runs[name] = (q, kc, vc)
    assert qkv_rope.fusable(xq, wq, b, heads, kv_heads, tactic.as_dict(), out_dtype=dtype)
    fp8 = make_fp8_linear(tactic)
    kc, vc = caches()
    q = unfused_qkv_rope(
        lambda x_, w_, b_: fp8(x_, w_, ws, xs, b_, out_dtype=dtype), make_rope_write_kv(None),
        xq, wq, b, pos, cos, sin, kc, vc, slots, heads, kv_heads, **scales,
    )  # fmt: skip
    runs["unfused"] = (q, kc, vc)
    _compare_qkv_rope_runs(runs, slots, exact, device)
    return runs


def w4a16_qkv_rope_fused_vs_unfused(
    tactic, T, heads, kv_heads, hd, kv_dtype, bias=False, exact=True, dtype=torch.bfloat16,
    device="cpu", K=256, pqs=True,
):  # fmt: skip
    """`qkv_rope_fused_vs_unfused` with INT4 AWQ weights (plugin w4a16_qkv_rope_gemm; tactic:
    a w4a16_gemm pair): the fused kernel against the W4A16 GEMV of the same tactic then the
    RoPE + KV write kernel, and against the reference (`quant.reference.w4a16_qkv_rope_linear`)."""
    from ingot.plugins.gemm.reference import unfused_qkv_rope
    from ingot.plugins.quant import reference as qref
    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.quant import w4a16_qkv_rope as wq
    from ingot.plugins.rope.triton_kernels import make_rope_write_kv

    x, _, b, pos, cos, sin, slots, scales, caches = _qkv_rope_case(
        T, heads, kv_heads, hd, kv_dtype, bias, dtype, device, K
    )
    gen = torch.Generator().manual_seed(T + hd + K)
    N = (heads + 2 * kv_heads) * hd
    qweight = qref.pack_w4_engine(torch.randint(0, 16, (N, K), generator=gen)).to(device)
    ws = (torch.rand(N, K // 128, generator=gen) * 0.02 + 0.005).to(dtype).to(device)
    p = (torch.rand(K, generator=gen) + 0.5).to(dtype).to(device) if pqs else None
    w_args = (qweight, ws, p, 128, None)
    runs = {}
    for name, fn in (
        ("fused", wq.make_w4a16_qkv_rope_linear(tactic)),
        ("reference", qref.make_w4a16_qkv_rope_linear(None)),
    ):
        kc, vc = caches()
        q = fn(x, *w_args, b, pos, cos, sin, kc, vc, slots, heads, kv_heads, **scales)
        runs[name] = (q, kc, vc)
    dec, _ = tw._split_params(tactic)
    assert wq.fusable(x, *w_args, b, heads, kv_heads, dec)
    w4 = tw.make_w4a16_linear(tactic)
    kc, vc = caches()
    q = unfused_qkv_rope(
        lambda x_, w_, b_: w4(x_, w_, ws, p, 128, None, b_), make_rope_write_kv(None),
        x, qweight, b, pos, cos, sin, kc, vc, slots, heads, kv_heads, **scales,
    )  # fmt: skip
    runs["unfused"] = (q, kc, vc)
    _compare_qkv_rope_runs(runs, slots, exact, device)
    return runs


def w4a16_packed_model(x, qweight, scales, pre_quant_scale, bias=None) -> torch.Tensor:
    """What the packed W4A16 GEMV computes (plugins/quant/triton_w4a16.py `_packed_dot`), in
    torch on the CPU: per engine word (8 codes, group 128), the codes' halves (nibbles 0-3 and
    4-7) each give code - 8 times x (exact) summed in bf16, each sum rounded to nearest-even
    as the bf16x2 fmas do; the two halves and the words are then added in fp32 with the
    block's scale. x: [T, K] bf16 -> [T, N] float32 (before the output's rounding)."""
    from ingot.plugins.quant import reference as qref

    x = x.cpu()
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.cpu().to(x.dtype)
    T, K = x.shape
    words = qref.unpack_int4(qweight.cpu())  # [N, K] in word order: word c, nibble j
    N = words.shape[0]
    v = (words - 8).float().reshape(N, K // 128, 16, 8)  # [N, block, c, j]
    xv = x.float().reshape(T, K // 128, 8, 16).transpose(2, 3)  # [T, block, c, j]: k = 16j + c
    words_sum = torch.zeros(T, N, K // 128, 16)
    for h in range(2):
        acc = torch.zeros(T, N, K // 128, 16)
        for j in range(4):
            prod = v[None, :, :, :, 4 * h + j] * xv[:, None, :, :, 4 * h + j]
            acc = (prod + acc).to(torch.bfloat16).float()  # exact sum, one rounding
        words_sum += acc
    y = (words_sum * scales.cpu().float()[None, :, :, None]).sum((2, 3))
    return y if bias is None else y + bias.cpu().float()
