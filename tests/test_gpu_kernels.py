"""GPU kernels against their CPU references (run on upcast float32 copies).

Every output is poisoned with NaN before the call, so an unwritten element fails; every input is
fresh random data; every tactic of every kernel is exercised. Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import rel_err

from ingot.plugins.activation import reference as act_ref
from ingot.plugins.activation import triton_kernels as act_tk
from ingot.plugins.attention import reference as attn_ref
from ingot.plugins.attention import triton_decode as dec
from ingot.plugins.attention import triton_kv_write as kvw
from ingot.plugins.attention import triton_prefill as pf
from ingot.plugins.gemm import cuda as gemm_cuda
from ingot.plugins.gemm import reference as gemm_ref
from ingot.plugins.norm import reference as norm_ref
from ingot.plugins.norm import triton_kernels as norm_tk
from ingot.plugins.rope import reference as rope_ref
from ingot.plugins.rope import triton_kernels as rope_tk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16
TOL = 1e-2


def nan_like(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    return torch.full(shape or t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)


def ids(tactics):
    return [t.name for t in tactics]


# the 2,048-token candidates and the short-prompt ones (a tactic's `prompts:` part)
ALL_PREFILL = pf.PREFILL_TACTICS + pf.SHORT_PROMPT_TACTICS


# --------------------------------------------------------------------------- norm


@pytest.mark.parametrize("tactic", norm_tk.RMS_NORM_TACTICS, ids=ids(norm_tk.RMS_NORM_TACTICS))
@pytest.mark.parametrize("shape", [(1, 4096), (7, 4096), (300, 1000), (2, 3, 5120)])
def test_rms_norm(tactic, shape):
    x = torch.randn(shape, device=DEV, dtype=BF16)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV)).to(BF16)
    out = norm_tk.make_rms_norm(tactic)(x, w, 1e-5, out=nan_like(x))
    ref = norm_ref.rms_norm(x.float().cpu(), w.float().cpu(), 1e-5)
    assert out.shape == x.shape and out.dtype == BF16
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("tactic", norm_tk.RMS_NORM_TACTICS, ids=ids(norm_tk.RMS_NORM_TACTICS))
@pytest.mark.parametrize("shape", [(1, 4096), (9, 4096), (300, 1000)])
@pytest.mark.parametrize("inplace", [False, True])
def test_add_rms_norm(tactic, shape, inplace):
    x = torch.randn(shape, device=DEV, dtype=BF16)
    r = torch.randn(shape, device=DEV, dtype=BF16)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEV)).to(BF16)
    ref_n, ref_r = norm_ref.add_rms_norm(x.float().cpu(), r.float().cpu(), w.float().cpu(), 1e-5)
    r_out = r if inplace else nan_like(r)
    out, new_r = norm_tk.make_add_rms_norm(tactic)(
        x, r, w, 1e-5, out=nan_like(x), residual_out=r_out
    )
    assert new_r.data_ptr() == r_out.data_ptr()
    assert rel_err(out, ref_n) < TOL and rel_err(new_r, ref_r) < TOL


def test_norm_no_out_args():
    x = torch.randn(5, 256, device=DEV, dtype=BF16)
    w = torch.randn(256, device=DEV, dtype=BF16)
    out = norm_tk.make_rms_norm(None)(x, w, 1e-6)
    assert rel_err(out, norm_ref.rms_norm(x.float().cpu(), w.float().cpu(), 1e-6)) < TOL
    n, r = norm_tk.make_add_rms_norm(None)(x, x, w, 1e-6)
    ref_n, ref_r = norm_ref.add_rms_norm(x.float().cpu(), x.float().cpu(), w.float().cpu(), 1e-6)
    assert rel_err(n, ref_n) < TOL and rel_err(r, ref_r) < TOL


# --------------------------------------------------------------------------- rope / kv write


def _qkv(T, hq, hkv, hd):
    """q, k, v as strided views of one fused projection, as the decoder produces them."""
    qkv = torch.randn(T, (hq + 2 * hkv) * hd, device=DEV, dtype=BF16)
    q = qkv[:, : hq * hd].view(T, hq, hd)
    k = qkv[:, hq * hd : (hq + hkv) * hd].view(T, hkv, hd)
    v = qkv[:, (hq + hkv) * hd :].view(T, hkv, hd)
    return q, k, v


def _cos_sin(hd, kind):
    if kind == "llama3":
        f = rope_ref.inv_freq(
            hd, 500000.0, "llama3", factor=8.0, original_max_position_embeddings=8192
        )
    else:
        f = rope_ref.inv_freq(hd, 10000.0)
    cos, sin = rope_ref.cos_sin_cache(f, 16384)
    return cos.to(DEV), sin.to(DEV)


@pytest.mark.parametrize("tactic", rope_tk.ROPE_TACTICS, ids=ids(rope_tk.ROPE_TACTICS))
@pytest.mark.parametrize("kind", ["default", "llama3"])
@pytest.mark.parametrize(
    "T,hq,hkv,hd", [(1, 32, 8, 128), (37, 32, 4, 128), (5, 8, 1, 64), (3, 12, 2, 80)]
)
def test_rope(tactic, kind, T, hq, hkv, hd):
    q, k, _ = _qkv(T, hq, hkv, hd)
    cos, sin = _cos_sin(hd, kind)
    pos = torch.randint(0, 16384, (T,), device=DEV)
    oq, ok = rope_tk.make_rope(tactic)(
        q, k, pos, cos, sin, q_out=nan_like(q, q.shape), k_out=nan_like(k, k.shape)
    )
    rq, rk = rope_ref.apply_rope(q.float().cpu(), k.float().cpu(), pos.cpu(), cos.cpu(), sin.cpu())
    assert rel_err(oq, rq) < TOL and rel_err(ok, rk) < TOL
    # default outputs, int32 positions
    oq2, ok2 = rope_tk.make_rope(tactic)(q, k, pos.int(), cos, sin)
    assert rel_err(oq2, rq) < TOL and rel_err(ok2, rk) < TOL


def _cache(nb, bs, hkv, hd):
    return (
        torch.randn(nb, bs, hkv, hd, device=DEV, dtype=BF16),
        torch.randn(nb, bs, hkv, hd, device=DEV, dtype=BF16),
    )


@pytest.mark.parametrize("tactic", rope_tk.ROPE_TACTICS, ids=ids(rope_tk.ROPE_TACTICS))
@pytest.mark.parametrize("T,hq,hkv,hd,bs", [(1, 32, 8, 128, 16), (45, 32, 4, 64, 32)])
def test_rope_write_kv(tactic, T, hq, hkv, hd, bs):
    q, k, v = _qkv(T, hq, hkv, hd)
    cos, sin = _cos_sin(hd, "llama3")
    pos = torch.randint(0, 16384, (T,), device=DEV)
    nb = T // bs + 4
    kc, vc = _cache(nb, bs, hkv, hd)
    slots = torch.randperm(nb * bs, device=DEV)[:T].int()
    if T > 1:
        slots[-1] = -1  # padding token: skipped
    kc_ref, vc_ref = kc.float().cpu(), vc.float().cpu()
    rq, rk = rope_ref.apply_rope(q.float().cpu(), k.float().cpu(), pos.cpu(), cos.cpu(), sin.cpu())
    keep = slots.cpu() >= 0
    attn_ref.write_kv(rk[keep], v.float().cpu()[keep], kc_ref, vc_ref, slots.cpu()[keep])
    oq = rope_tk.make_rope_write_kv(tactic)(
        q, k, v, pos, cos, sin, kc, vc, slots, q_out=nan_like(q, q.shape)
    )
    assert rel_err(oq, rq) < TOL
    assert rel_err(kc, kc_ref) < TOL and rel_err(vc, vc_ref) < 1e-6


@pytest.mark.parametrize("tactic", kvw.KV_WRITE_TACTICS, ids=ids(kvw.KV_WRITE_TACTICS))
@pytest.mark.parametrize("T,hkv,hd,bs", [(1, 8, 128, 16), (77, 4, 64, 32), (300, 8, 128, 16)])
def test_kv_write(tactic, T, hkv, hd, bs):
    _, k, v = _qkv(T, 4 * hkv, hkv, hd)
    nb = T // bs + 4
    kc, vc = _cache(nb, bs, hkv, hd)
    slots = torch.randperm(nb * bs, device=DEV)[:T].int()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    attn_ref.write_kv(k, v, kc_ref, vc_ref, slots)
    kvw.make_write_kv(tactic)(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


# --------------------------------------------------------------------------- swiglu / gemm


@pytest.mark.parametrize("tactic", act_tk.SWIGLU_TACTICS, ids=ids(act_tk.SWIGLU_TACTICS))
@pytest.mark.parametrize("T,inter", [(1, 14336), (33, 14336), (5, 1000)])
def test_swiglu(tactic, T, inter):
    x = torch.randn(T, 2 * inter, device=DEV, dtype=BF16) * 3
    out = act_tk.make_swiglu(tactic)(x, out=nan_like(x, (T, inter)))
    assert rel_err(out, act_ref.swiglu(x.float().cpu())) < TOL
    assert rel_err(act_tk.make_swiglu(tactic)(x), act_ref.swiglu(x.float().cpu())) < TOL


@pytest.mark.parametrize(
    "T,N,K",
    [(1, 6144, 4096), (4, 4096, 14336), (1, 1000, 333), (17, 4096, 14336), (128, 1000, 512)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm(T, N, K, bias):
    x = torch.randn(T, K, device=DEV, dtype=BF16)
    w = torch.randn(N, K, device=DEV, dtype=BF16) / math.sqrt(K)
    b = torch.randn(N, device=DEV, dtype=BF16) if bias else None
    ref = gemm_ref.linear(x.float(), w.float(), b.float() if bias else None)
    for tactic in (None, *gemm_cuda.GEMM_TACTICS):
        f = gemm_cuda.make_linear(tactic)
        assert rel_err(f(x, w, b), ref) < TOL
        assert rel_err(f(x, w, b, out=nan_like(x, (T, N))), ref) < TOL


def test_embedding():
    w = torch.randn(1000, 512, device=DEV, dtype=BF16)
    ids_ = torch.randint(0, 1000, (37,), device=DEV, dtype=torch.int32)
    ref = gemm_ref.embedding(ids_.cpu(), w.cpu())
    for tactic in gemm_cuda.EMBEDDING_TACTICS:
        f = gemm_cuda.make_embedding(tactic)
        assert torch.equal(f(ids_, w).cpu(), ref)
        assert torch.equal(f(ids_, w, out=nan_like(w, (37, 512))).cpu(), ref)


# --------------------------------------------------------------------------- paged attention


def paged_problem(ctxs, qlens, hq, hkv, hd, bs, spare_blocks=3):
    """Random paged KV for sequences of context ctxs[b] whose last qlens[b] tokens are queries.
    Cache slots that belong to no sequence's context hold NaN, so any unmasked read shows."""
    B = len(ctxs)
    nblk = [(c + bs - 1) // bs for c in ctxs]
    width = max(nblk) + spare_blocks
    nb = sum(nblk) + spare_blocks
    kc = torch.full((nb, bs, hkv, hd), float("nan"), device=DEV, dtype=BF16)
    vc = torch.full((nb, bs, hkv, hd), float("nan"), device=DEV, dtype=BF16)
    perm = torch.randperm(nb, device=DEV).int()
    bt = torch.zeros(B, width, dtype=torch.int32, device=DEV)
    used = 0
    for b, c in enumerate(ctxs):
        blocks = perm[used : used + nblk[b]]
        used += nblk[b]
        bt[b, : nblk[b]] = blocks
        bt[b, nblk[b] :] = perm[-1]  # garbage but in range
        flat = (blocks.long()[:, None] * bs + torch.arange(bs, device=DEV)).reshape(-1)[:c]
        kc.view(-1, hkv, hd)[flat] = torch.randn(c, hkv, hd, device=DEV, dtype=BF16)
        vc.view(-1, hkv, hd)[flat] = torch.randn(c, hkv, hd, device=DEV, dtype=BF16)
    T = sum(qlens)
    q = torch.randn(T, hq, hd, device=DEV, dtype=BF16)
    qsl = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    qsl[1:] = torch.tensor(qlens, device=DEV).cumsum(0)
    cl = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
    return q, kc, vc, bt, cl, qsl


def attn_reference(q, kc, vc, bt, cl, qsl, scale, window):
    # NaN slots are never read by the reference (it gathers exactly ctx tokens)
    return attn_ref.paged_attention(
        q.float().cpu(),
        kc.float().cpu(),
        vc.float().cpu(),
        bt.cpu(),
        cl.cpu(),
        qsl.cpu(),
        scale,
        window,
    )


def check_attention(fn, ctxs, qlens, hq, hkv, hd, bs, window=None, **kw):
    q, kc, vc, bt, cl, qsl = paged_problem(ctxs, qlens, hq, hkv, hd, bs)
    scale = 1 / math.sqrt(hd)
    out = fn(q, kc, vc, bt, cl, qsl, scale, window, out=nan_like(q), **kw)
    err = rel_err(out, attn_reference(q, kc, vc, bt, cl, qsl, scale, window))
    assert err < TOL, err


GQA = [(32, 8), (32, 4), (8, 8)]  # Hq/Hkv = 4, 8, 1


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("window", [None, 1000])
def test_decode_shapes(hq, hkv, hd, bs, window):
    ctxs = [1, 17, 4099, 8197, 2048]
    fn = dec.make_paged_attention(None)
    check_attention(fn, ctxs, [1] * len(ctxs), hq, hkv, hd, bs, window, max_query_len=1)


@pytest.mark.parametrize("tactic", dec.DECODE_TACTICS, ids=ids(dec.DECODE_TACTICS))
def test_decode_tactics(tactic):
    fn = dec.make_decode_attention(tactic)
    ctxs = [4100, 300, 1, 33]
    check_attention(fn, ctxs, [1] * 4, 32, 8, 128, 16)
    check_attention(fn, ctxs, [1] * 4, 32, 8, 128, 16, max_context_len=4100)
    check_attention(fn, [700], [1], 32, 8, 128, 32, window=129)


def test_decode_single_split_and_metadata():
    fn = dec.make_paged_attention(None)
    # a max_context_len that fits one partition takes the no-reduce path
    check_attention(fn, [50, 100], [1, 1], 32, 8, 128, 16, max_query_len=1, max_context_len=100)
    # no metadata: derived with one host sync
    check_attention(fn, [50, 3000], [1, 1], 32, 8, 128, 16)


def test_decode_cuda_graph():
    """The decode path captures into a CUDA graph and replays correctly with new lengths."""
    ctxs = [3000, 70, 1]
    q, kc, vc, bt, cl, qsl = paged_problem(ctxs, [1, 1, 1], 32, 8, 128, 16)
    fn = dec.make_paged_attention(None)
    scale = 1 / math.sqrt(128)
    max_ctx = bt.shape[1] * 16
    out = nan_like(q)
    fn(q, kc, vc, bt, cl, qsl, scale, None, max_query_len=1, max_context_len=max_ctx, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            fn(
                q,
                kc,
                vc,
                bt,
                cl,
                qsl,
                scale,
                None,
                max_query_len=1,
                max_context_len=max_ctx,
                out=out,
            )
    torch.cuda.current_stream().wait_stream(s)
    for new_ctx in ([2999, 69, 1], [1000, 16, 1]):
        cl.copy_(torch.tensor(new_ctx, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, attn_reference(q, kc, vc, bt, cl, qsl, scale, None)) < TOL


PREFILL_CASES = [
    # (context lens, query lens): whole prompts, chunked prefill over a cached prefix, mixed
    ([100], [100]),
    ([1, 37, 500, 129], [1, 37, 500, 129]),
    ([4100, 300], [600, 300]),
    ([2000, 64, 900, 5], [1, 64, 100, 2]),
    ([130, 40], [0, 40]),
]


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_shapes(hq, hkv, hd, bs, case):
    ctxs, qlens = PREFILL_CASES[case]
    fn = dec.make_paged_attention(None)
    check_attention(fn, ctxs, qlens, hq, hkv, hd, bs, None, max_query_len=max(qlens))


@pytest.mark.parametrize("window", [1, 100, 333])
@pytest.mark.parametrize("hd", [64, 128])
def test_prefill_sliding_window(window, hd):
    fn = dec.make_paged_attention(None)
    check_attention(fn, [1000, 400], [700, 1], 32, 8, hd, 16, window)
    check_attention(fn, [2000], [1], 32, 4, hd, 32, window)  # decode through the dispatcher


@pytest.mark.parametrize("tactic", ALL_PREFILL, ids=ids(ALL_PREFILL))
def test_prefill_tactics(tactic):
    fn = pf.make_prefill_attention(tactic)
    check_attention(fn, [4100, 300, 77], [600, 300, 1], 32, 8, 128, 16, max_query_len=600)
    check_attention(fn, [900, 50], [900, 20], 32, 4, 64, 32, 200)  # grid sized by q.shape[0]


@pytest.mark.parametrize(
    "tactic", dec.PAGED_ATTENTION_TACTICS, ids=ids(dec.PAGED_ATTENTION_TACTICS)
)
def test_paged_attention_tactics(tactic):
    fn = dec.make_paged_attention(tactic)
    check_attention(fn, [2100, 5], [1, 1], 32, 8, 128, 16, max_query_len=1)
    check_attention(fn, [300, 5], [200, 5], 32, 8, 128, 16, max_query_len=200)


@pytest.mark.parametrize("bs", [16, 32])
def test_paged_attention_large_batch_decode(bs):
    """40 sequences x 8 kv heads >= LARGE_BATCH_ROWS: the large-batch decode tactic runs."""
    torch.manual_seed(3)
    ctxs = torch.randint(1, 900, (40,)).tolist()
    assert 40 * 8 >= dec.LARGE_BATCH_ROWS
    for large in dec.LARGE_BATCH_TACTICS:
        tactic = dec.combine_tactics(dec.DECODE_TACTICS[0], pf.PREFILL_TACTICS[0], large)
        fn = dec.make_paged_attention(tactic)
        check_attention(fn, ctxs, [1] * 40, 32, 8, 128, bs, max_query_len=1)
        check_attention(fn, ctxs, [1] * 40, 32, 8, 128, bs, 200, max_query_len=1)
