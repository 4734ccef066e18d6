"""The RMSNorm folded into the decode GEMVs (plugins/gemm/fused_norm.py), checked against the
unfused ops: the add + RMSNorm kernel between two GEMVs. Run on the CPU by Triton's interpreter
(tests/test_fused_norm_interp.py) and on the GPU (tests/test_gpu_gemv.py)."""

from __future__ import annotations

import torch
from kernel_checks import rel_err

from ingot.plugins import pdl
from ingot.plugins.gemm import cuda
from ingot.plugins.gemm.fused_norm import AddOut, NormIn, new_sums, normed_input, row_sums
from ingot.plugins.norm.reference import rms_norm
from ingot.plugins.norm.triton_kernels import make_add_rms_norm, make_rms_norm

F8 = torch.float8_e4m3fn


def gemv_tactics(rows: int):
    """The GEMV tactics that take `rows` rows of x: the narrowest and the widest."""
    cands = [t for t in cuda.GEMM_TACTICS if cuda.gemv_rows(t.as_dict().get("max_m", 0)) >= rows]
    return [min(cands, key=lambda t: t.as_dict()["block_n"]),
            max(cands, key=lambda t: t.as_dict()["block_n"])]  # fmt: skip


def _inputs(T, K, N, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype).to(device)

    return dict(y_in=r(T, K), w_o=r(N, K, s=K**-0.5), residual=r(T, N, s=4.0),
                norm_w=(1 + r(N, s=0.2).float()).to(dtype), w_next=r(64, N, s=N**-0.5))  # fmt: skip


def add_out_then_norm_in(T: int, K: int, N: int, device, use_pdl: bool = False) -> None:
    """o -> add + RMSNorm -> gate_up, unfused (GEMV, norm kernel, GEMV) and folded (GEMV adding
    into the residual, GEMV normalizing as it loads): the same residual bits, sums of squares
    within fp32 rounding of the exact ones, the next GEMV's output within bf16 rounding."""
    for tactic in gemv_tactics(T):
        linear = cuda.make_linear(tactic)
        a = _inputs(T, K, N, device)
        eps = 1e-5
        with pdl.scope(use_pdl):
            o = linear(a["y_in"], a["w_o"])
            x_ref, res_ref = make_add_rms_norm(None)(o, a["residual"].clone(), a["norm_w"], eps)
            out_ref = linear(x_ref, a["w_next"])

            sums = new_sums(1, T, device)[0]
            res = a["residual"].clone()
            got = linear(a["y_in"], a["w_o"], add=AddOut(res, sums))
            assert got is res
            assert torch.equal(res, res_ref), tactic.name
            exact = res.double().pow(2).sum(-1)
            ss = row_sums(sums).double()
            assert ((ss - exact).abs() <= 1e-6 * exact + 1e-9).all(), (ss, exact)
            out = linear(res, a["w_next"], norm=NormIn(a["norm_w"], eps, sums))
        assert rel_err(out, out_ref) < 1e-2, tactic.name
        # the x the folded GEMV multiplies (its math in torch) against the reference norm's:
        # the fixed-point sums move rstd by its last bits at most, so an ulp here and there
        x_folded = normed_input(res, NormIn(a["norm_w"], eps, sums))
        x_torch = rms_norm(res, a["norm_w"], eps)
        diff = (x_folded.float() - x_torch.float()).abs()
        assert (diff <= x_torch.float().abs() * 2**-7).all()
        assert (diff > 0).float().mean() < 0.02, (diff > 0).float().mean()


def sums_do_not_depend_on_the_programs(device) -> None:
    """The same AddOut twice, from zero: the same fixed-point sums, to the bit."""
    tactic = gemv_tactics(1)[0]
    a = _inputs(1, 96, 256, device, seed=3)
    out = []
    for _ in range(2):
        sums, res = new_sums(1, 1, device)[0], a["residual"].clone()
        cuda.make_linear(tactic)(a["y_in"], a["w_o"], add=AddOut(res, sums))
        out.append(sums.clone())
    assert torch.equal(out[0], out[1])


def large_sums_take_the_coarse_sum(device) -> None:
    """A residual stream whose sum of squares passes 2^31 (the fine sum's range): the coarse
    sum stands in, within its rounding of one per program share."""
    tactic = gemv_tactics(1)[0]
    a = _inputs(1, 64, 128, device, seed=5)
    res = (a["residual"].float() * 8000).to(torch.bfloat16)
    sums = new_sums(1, 1, device)[0]
    cuda.make_linear(tactic)(a["y_in"], a["w_o"], add=AddOut(res, sums))
    exact = res.double().pow(2).sum(-1)
    assert exact.item() > 2**31
    assert (row_sums(sums).double() - exact).abs().item() <= 1e-6 * exact.item()
    linear = cuda.make_linear(tactic)
    out = linear(res, a["w_next"], norm=NormIn(a["norm_w"], 1e-5, sums))
    ref = linear(make_rms_norm(None)(res, a["norm_w"], 1e-5), a["w_next"])
    assert rel_err(out, ref) < 1e-2


def fallbacks_match(device) -> None:
    """Calls the GEMV kernel does not take (more rows than the tactic's max_m, a cuBLAS
    tactic) give what the folded kernel gives, through the unfused math."""
    T, K, N = 1, 64, 128
    gemv, cublas = gemv_tactics(1)[0], next(t for t in cuda.GEMM_TACTICS if t.name == "cublas")
    # NOTE: fp16: the interpreter rounds to bf16 by truncation, 1e-2 off cuBLAS on its own
    a = _inputs(T, K, N, device, torch.float16, seed=7)
    results = []
    for tactic in (gemv, cublas):
        linear = cuda.make_linear(tactic)
        sums, res = new_sums(1, T, device)[0], a["residual"].clone()
        linear(a["y_in"], a["w_o"], add=AddOut(res, sums))
        out = linear(res, a["w_next"], norm=NormIn(a["norm_w"], 1e-5, sums))
        exact = res.double().pow(2).sum(-1)
        assert torch.allclose(row_sums(sums).double(), exact, rtol=1e-6)
        results.append((res, out))
    (r1, o1), (r2, o2) = results  # the GEMMs sum in their own orders: bf16 rounding apart
    assert rel_err(r2, r1) < 1e-2
    assert rel_err(o2, o1) < 1e-2


def swiglu_down_adds(T: int, device) -> None:
    """The down projection with SwiGLU fused in, adding into the residual stream: the bits of
    SwiGLU-down then the residual add."""
    tactic = gemv_tactics(T)[0]
    g = torch.Generator(device="cpu").manual_seed(11)
    dt = torch.float16  # (the interpreter truncates to bf16; the add here rounds to nearest)
    gate_up = torch.randn(T, 2 * 96, generator=g).to(dt).to(device)
    w = (torch.randn(128, 96, generator=g) * 0.1).to(dt).to(device)
    residual = torch.randn(T, 128, generator=g).to(dt).to(device)
    fn = cuda.make_swiglu_linear(tactic)
    y = fn(gate_up, w)
    sums, res = new_sums(1, T, device)[0], residual.clone()
    assert fn(gate_up, w, add=AddOut(res, sums)) is res
    assert torch.equal(res, (y.float() + residual.float()).to(dt))


def fp8_norm_in_quantizes_after_the_norm(T: int, device) -> None:
    """FP8 GEMV with the norm folded in: x normalized, then quantized with the input scale as
    loaded; the norm-quantize kernel then the FP8 GEMV give the same result (fp8 bits of x
    equal wherever the normalized bf16 value is)."""
    from ingot.plugins.quant.cuda_fp8 import FP8_GEMM_TACTICS, make_fp8_linear
    from ingot.plugins.quant.triton_quantize import make_rms_norm_quant_fp8

    tactic = next(t for t in FP8_GEMM_TACTICS if cuda.gemv_rows(t.as_dict().get("max_m", 0)) >= T)
    K, N = 128, 64
    a = _inputs(T, 64, K, device, seed=13)
    g = torch.Generator(device="cpu").manual_seed(17)
    w = (torch.randn(N, K, generator=g) * 0.05).to(F8).to(device)
    ws = torch.tensor(0.02, device=device)
    xs = torch.tensor(0.05, device=device)
    fp8 = make_fp8_linear(tactic)
    linear = cuda.make_linear(gemv_tactics(T)[0])
    o = linear(a["y_in"], a["w_o"])
    xq, res_ref = make_rms_norm_quant_fp8(None)(o, a["norm_w"], 1e-5, xs, a["residual"].clone())
    assert xq.dtype == F8
    ref = fp8(xq, w, ws, xs, out_dtype=torch.bfloat16)
    sums, res = new_sums(1, T, device)[0], a["residual"].clone()
    linear(a["y_in"], a["w_o"], add=AddOut(res, sums))
    assert torch.equal(res, res_ref)
    got = fp8(res, w, ws, xs, out_dtype=torch.bfloat16, norm=NormIn(a["norm_w"], 1e-5, sums))
    assert rel_err(got, ref) < 5e-2


def qkv_rope_norm_in(T: int, device, fp8: bool = False) -> None:
    """The QKV GEMV with RoPE + KV write in its epilogue, normalizing x as it loads it: q and
    the caches as the norm kernel, then the same kernel, give them (within bf16 rounding).
    fp8: FP8 weights (plugin fp8_qkv_rope_gemm), x quantized after the norm as it is loaded,
    against the norm-quantize kernel then the same plugin on its FP8 output."""
    from ingot.plugins.attention.layout import v_like
    from ingot.plugins.gemm import qkv_rope
    from ingot.plugins.quant.triton_quantize import make_rms_norm_quant_fp8
    from ingot.plugins.rope import reference as rope_ref

    tactics = qkv_rope.FP8_QKV_ROPE_TACTICS if fp8 else qkv_rope.QKV_ROPE_TACTICS
    tactic = next(t for t in tactics if cuda.gemv_rows(t.as_dict()["max_m"]) >= T)
    heads, kv_heads, hd, bs = 4, 2, 16, 16
    a = _inputs(T, 64, 128, device, seed=19)
    g = torch.Generator(device="cpu").manual_seed(23)
    w = (torch.randn((heads + 2 * kv_heads) * hd, 128, generator=g) * 0.1).to(torch.bfloat16)
    w = w.to(device)
    cos, sin = (t.to(device) for t in rope_ref.cos_sin_cache(rope_ref.inv_freq(hd, 1e4), 64))
    pos = torch.arange(T, dtype=torch.int32, device=device) + 5
    slots = torch.arange(T, dtype=torch.int32, device=device) + 3
    linear = cuda.make_linear(gemv_tactics(T)[0])
    o = linear(a["y_in"], a["w_o"])
    x_ref, res_ref = make_add_rms_norm(None)(o, a["residual"].clone(), a["norm_w"], 1e-5)
    if fp8:  # the unfolded FP8 engine quantizes in its norm kernel
        ws, xs = torch.tensor(0.002, device=device), torch.tensor(0.05, device=device)
        w = (w.float() / ws).to(F8)
        x_ref, _ = make_rms_norm_quant_fp8(None)(o, a["norm_w"], 1e-5, xs, a["residual"].clone())
        fn = qkv_rope.make_fp8_qkv_rope_linear(tactic)

        def call(x, *rest, **kw):
            return fn(x, w, ws, xs, *rest, out_dtype=torch.bfloat16, **kw)
    else:
        fn = qkv_rope.make_qkv_rope_linear(tactic)

        def call(x, *rest, **kw):
            return fn(x, w, *rest, **kw)

    sums, res = new_sums(1, T, device)[0], a["residual"].clone()
    linear(a["y_in"], a["w_o"], add=AddOut(res, sums))
    assert torch.equal(res, res_ref)
    norm = NormIn(a["norm_w"], 1e-5, sums)
    out_dtype = torch.bfloat16 if fp8 else None
    assert qkv_rope.fusable(res, w, None, heads, kv_heads, tactic.as_dict(), norm, out_dtype)
    runs = []
    for x, kw in ((x_ref, {}), (res, {"norm": norm})):
        kc = torch.zeros(2, bs, kv_heads, hd, dtype=torch.bfloat16, device=device)
        vc = v_like(kc)
        q = call(x, None, pos, cos, sin, kc, vc, slots, heads, kv_heads, **kw)
        runs.append((q, kc, vc))
    for want, got in zip(*runs, strict=True):
        # FP8: an x element whose normalized value sits at a rounding boundary may quantize
        # one FP8 step apart in the two paths (fp8_norm_in_quantizes_after_the_norm)
        assert rel_err(got, want) < (3e-2 if fp8 else 1e-2)


def w4a16_folds(T: int, device, packed: bool, use_pdl: bool = False) -> None:
    """INT4 (W4A16 GEMVs, plugins/quant/triton_w4a16.py): o -> add + RMSNorm -> gate_up and
    down (SwiGLU inside) -> add + RMSNorm -> qkv, folded and unfolded: the residual bits of the
    add + RMSNorm kernel, sums of squares within fp32 rounding of the exact ones, the next
    GEMV's output within bf16 rounding of it on the kernel's x; calls the GEMV does not take
    (T past max_m) give the same residual through the torch math. packed: the bf16x2 kernel
    (bf16); else the fp32 one (fp16: the interpreter's bf16 casts truncate)."""
    from ingot.plugins.activation.triton_kernels import make_swiglu
    from ingot.plugins.quant import reference as qref
    from ingot.plugins.quant import triton_w4a16 as tw

    dt = torch.bfloat16 if packed else torch.float16
    dec = next(t for t in tw.DECODE_TACTICS
               if bool(t.as_dict().get("packed")) == packed and t.as_dict()["max_m"] >= T)  # fmt: skip
    fn = tw.make_w4a16_linear(tw.combine_tactics(dec, tw.GEMM_TACTICS[0]))
    g = torch.Generator(device="cpu").manual_seed(29)

    def w4(n, k):  # qweight, scales, pre_quant_scale
        codes = torch.randint(0, 16, (n, k), generator=g)
        scales = (torch.rand(n, k // 128, generator=g) * 0.01 + 0.002).to(dt)
        pqs = (torch.rand(k, generator=g) + 0.5).to(dt)
        return qref.pack_w4_engine(codes).to(device), scales.to(device), pqs.to(device)

    K, D, eps = 384, 256, 1e-5  # o: K -> D; down: SwiGLU of 2K -> D; next: D -> 128
    o_w, down_w, next_w = w4(D, K), w4(D, K), w4(128, D)
    x_o = torch.randn(T, K, generator=g).to(dt).to(device)
    gate_up = torch.randn(T, 2 * K, generator=g).to(dt).to(device)
    residual = (torch.randn(T, D, generator=g) * 4).to(dt).to(device)
    norm_w = (1 + torch.randn(D, generator=g) * 0.2).to(dt).to(device)
    add_rms_norm = make_add_rms_norm(None)
    with pdl.scope(use_pdl):
        for x, w, kw in ((x_o, o_w, {}), (gate_up, down_w, {"gated": True})):
            y = fn(x, *w, 128, **kw)
            x_ref, res_ref = add_rms_norm(y, residual.clone(), norm_w, eps)
            out_ref = fn(x_ref, *next_w, 128)
            sums, res = new_sums(1, T, device)[0], residual.clone()
            assert fn(x, *w, 128, add=AddOut(res, sums), **kw) is res
            assert torch.equal(res, res_ref), kw
            exact = res.double().pow(2).sum(-1)
            assert ((row_sums(sums).double() - exact).abs() <= 1e-6 * exact + 1e-9).all()
            out = fn(res, *next_w, 128, norm=NormIn(norm_w, eps, sums))
            assert rel_err(out, out_ref) < 1e-2, kw
    # past max_m: SwiGLU, the GEMM, the add in torch: the residual of SwiGLU-down, then add
    rows = dec.as_dict()["max_m"] + 1
    gate_up = torch.randn(rows, 2 * K, generator=g).to(dt).to(device)
    residual = torch.randn(rows, D, generator=g).to(dt).to(device)
    sums, res = new_sums(1, rows, device)[0], residual.clone()
    fn(gate_up, *down_w, 128, gated=True, add=AddOut(res, sums))
    y = fn(make_swiglu(None)(gate_up), *down_w, 128)
    assert torch.equal(res, (y.float() + residual.float()).to(dt))
