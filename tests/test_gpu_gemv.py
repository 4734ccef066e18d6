"""GEMV tactics of `plugins/gemm/cuda.py` against torch.nn.functional.linear in fp32.

Every output is poisoned with NaN before the call (an unwritten element fails); every input is
fresh random data; every tactic runs at the Llama-3.1-8B decode shapes and at odd shapes
(N, K not multiples of the blocks, T = 1..8, with and without bias). Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import rel_err as _rel_err

from ingot.plugins.gemm import cuda as gemm_cuda
from ingot.plugins.gemm.qkv_rope import FP8_QKV_ROPE_TACTICS as FP8_QKV_ROPE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16
TOL = 1e-2
GEMV = [t for t in gemm_cuda.GEMM_TACTICS if t.as_dict().get("max_m", 0) > 0]
IDS = [t.name for t in GEMV]
LLAMA = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    return _rel_err(out, ref)


def inputs(T, N, K, bias, dtype=BF16):
    x = torch.randn(T, K, device=DEV, dtype=dtype)
    w = (torch.randn(N, K, device=DEV, dtype=dtype) / math.sqrt(K)).to(dtype)
    b = torch.randn(N, device=DEV, dtype=dtype) if bias else None
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    return x, w, b, ref


def poisoned(T, N, dtype=BF16):
    return torch.full((T, N), float("nan"), device=DEV, dtype=dtype)


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn() run once (compiling outside the capture), then captured into a graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    return g


def test_tactic_names_stable_and_unique():
    names = [t.name for t in gemm_cuda.GEMM_TACTICS]
    assert "cublas" in names and len(set(names)) == len(names)
    for t in GEMV:
        p = t.as_dict()
        assert t.name.startswith(f"gemv_n{p['block_n']}_k{p['block_k']}_w{p['num_warps']}_")
        assert p["block_k"] >= 256 * p["num_warps"]  # all warps along K: one layout for x and w


@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
@pytest.mark.parametrize("site", list(LLAMA))
def test_gemv_llama_shapes(tactic, site):
    N, K = LLAMA[site]
    f = gemm_cuda.make_linear(tactic)
    for T, bias in ((1, False), (4, True), (3, False), (2, True), (8, True)):
        x, w, b, ref = inputs(T, N, K, bias)
        assert rel_err(f(x, w, b, out=poisoned(T, N)), ref) < TOL
    assert rel_err(f(x, w, b), ref) < TOL  # out=None allocates


@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
@pytest.mark.parametrize("N,K", [(1000, 333), (4099, 14336), (37, 4104), (3, 8), (130, 1032)])
def test_gemv_odd_shapes(tactic, N, K):
    f = gemm_cuda.make_linear(tactic)
    for T in range(1, 9):
        bias = T % 2 == 0
        x, w, b, ref = inputs(T, N, K, bias)
        if T > tactic.as_dict()["max_m"] or K % 8:
            # handed to cuBLAS: must give torch's own bf16 result (on the H200, cuBLAS itself
            # was 2.3% off the fp32 reference at T=8, N=37, K=4104 with bias)
            ref = F.linear(x, w, b).float()
        assert rel_err(f(x, w, b, out=poisoned(T, N)), ref) < TOL, (T, bias)


@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
def test_gemv_fp16_strided_out_and_fallback(tactic):
    f = gemm_cuda.make_linear(tactic)
    T = tactic.as_dict()["max_m"]  # largest batch the GEMV itself takes
    x, w, b, ref = inputs(T, 1000, 4096, True, dtype=torch.float16)
    assert rel_err(f(x, w, b, out=poisoned(T, 1000, torch.float16)), ref) < TOL
    # out as a column slice of a wider buffer (row stride != N); the rest must stay untouched
    big = poisoned(T, 1100)
    x, w, b, ref = inputs(T, 1000, 4096, True)
    f(x, w, b, out=big[:, :1000])
    assert rel_err(big[:, :1000], ref) < TOL
    assert torch.isnan(big[:, 1000:]).all()
    # T above max_m goes to cuBLAS inside the same tactic
    for T in (9, 33):
        x, w, b, ref = inputs(T, 1000, 512, T == 9)
        assert rel_err(f(x, w, b, out=poisoned(T, 1000)), ref) < TOL


def test_fp32_is_true_fp32():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # would allow TF32
    try:
        x = torch.randn(64, 4096, device=DEV, dtype=torch.float64)
        w = torch.randn(512, 4096, device=DEV, dtype=torch.float64)
        ref = x @ w.t()
        for t in gemm_cuda.GEMM_TACTICS[:3]:
            out = gemm_cuda.make_linear(t)(
                x[:1].float(), w.float(), out=poisoned(1, 512, torch.float32)
            )
            assert rel_err(out, ref[:1]) < 1e-5
            assert rel_err(gemm_cuda.make_linear(t)(x.float(), w.float()), ref) < 1e-5
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
def test_gemv_cuda_graph(tactic):
    """Captured once, replayed on new inputs written into the same buffers."""
    f = gemm_cuda.make_linear(tactic)
    N, K, T = 4096, 14336, tactic.as_dict()["max_m"]
    x, w, b, _ = inputs(T, N, K, True)
    out = poisoned(T, N)
    g = captured(lambda: f(x, w, b, out=out))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, F.linear(x.float(), w.float(), b.float())) < TOL


@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
def test_pdl_gemv_with_k_shorter_than_its_prefetch(tactic):
    """PDL GEMVs of tiny models: K inside the chunks loaded before the wait leaves the main
    loop nothing; its unrolled variants (u2) read far past the weights and faulted before
    the loop's bounds were kept in order (scripts/pdl_stress.py found it)."""
    from ingot.plugins import pdl

    f = gemm_cuda.make_linear(tactic)
    for N, K in ((64, 64), (128, 64), (40, 96), (256, 64), (130, 1032)):
        for T in range(1, tactic.as_dict()["max_m"] + 1):
            x, w, b, ref = inputs(T, N, K, T % 2 == 0)
            with pdl.scope(True):
                out = f(x, w, b, out=poisoned(T, N))
            torch.cuda.synchronize()
            assert rel_err(out, ref) < TOL, (N, K, T)


@pytest.mark.parametrize("trigger", ["after_wait", "before_wait"])
@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
def test_pdl_gemv_chain_in_a_graph(tactic, trigger):
    """Three PDL GEMVs, each reading the one before's output (x -> [14336] -> [4096] ->
    [4096]), their weights partly loaded before each wait (prefetch_chunks 1-4), captured and
    replayed on new x: a GEMV running ahead of its input would read the last replay's."""
    from ingot.plugins import pdl

    T = 1
    f = gemm_cuda.make_linear(tactic)
    x = torch.randn(T, 4096, device=DEV, dtype=BF16)
    ws = [torch.randn(n, k, device=DEV, dtype=BF16) / math.sqrt(k)
          for n, k in ((14336, 4096), (4096, 14336), (4096, 4096))]  # fmt: skip
    outs = [poisoned(T, w.shape[0]) for w in ws]
    prev = pdl.TRIGGER
    pdl.TRIGGER = trigger
    try:

        def chain():
            with pdl.scope(True):
                h = x
                for w, o in zip(ws, outs, strict=True):
                    h = f(h, w, out=o)

        g = captured(chain)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            h = x.float()
            for w, o in zip(ws, outs, strict=True):
                # each stage against fp32 on the stage's actual input (errors do not compound)
                assert rel_err(o, F.linear(h, w.float())) < TOL
                h = o.float()
    finally:
        pdl.TRIGGER = prev


@pytest.mark.parametrize(
    "tactic", gemm_cuda.GEMM_TACTICS, ids=[t.name for t in gemm_cuda.GEMM_TACTICS]
)
@pytest.mark.parametrize("T", [1, 2, 4, 8])
def test_swiglu_fused_into_down_gemv(tactic, T):
    """swiglu_gemm at the Llama down shape equals SwiGLU then the GEMM (fp32 reference), and the
    fused GEMV path equals the unfused kernels exactly where it is taken."""
    from ingot.plugins.activation.triton_kernels import make_swiglu
    from ingot.plugins.gemm.reference import swiglu_linear

    n, i = LLAMA["down"]
    gate_up = torch.randn(T, 2 * i, device=DEV, dtype=BF16)
    w = (torch.randn(n, i, device=DEV, dtype=BF16) / math.sqrt(i)).to(BF16)
    out = gemm_cuda.make_swiglu_linear(tactic)(gate_up, w)
    assert rel_err(out, swiglu_linear(gate_up.float(), w.float())) < TOL
    unfused = gemm_cuda.make_linear(tactic)(make_swiglu(None)(gate_up), w)
    assert torch.equal(out, unfused)


@pytest.mark.parametrize("tactic", GEMV, ids=IDS)
@pytest.mark.parametrize("kv_dtype", [BF16, torch.float8_e4m3fn], ids=["bf16_kv", "fp8_kv"])
def test_qkv_rope_gemv_llama_shapes(tactic, kv_dtype):
    """The QKV GEMV with RoPE + KV write in its epilogue (plugins/gemm/qkv_rope.py) against
    the GEMV then the RoPE kernel and the CPU reference: Llama-3.1-8B heads, K = 4,096, with
    bias (Qwen2) and without, every row count the tactic fuses."""
    from kernel_checks import qkv_rope_fused_vs_unfused

    for T in range(1, tactic.as_dict()["max_m"] + 1):
        qkv_rope_fused_vs_unfused(
            tactic, T, 32, 8, 128, kv_dtype, bias=T % 2 == 0, exact=False, device=DEV, K=4096
        )


@pytest.mark.parametrize("tactic", FP8_QKV_ROPE, ids=[t.name for t in FP8_QKV_ROPE])
def test_fp8_qkv_rope_gemv_llama_shapes(tactic):
    """The FP8 QKV GEMV with RoPE + KV write (FP8 cache) in its epilogue (plugin
    fp8_qkv_rope_gemm) against the FP8 GEMV then the RoPE kernel and the reference: Llama-3.1-8B
    heads, K = 4,096, with bias and without, every row count the tactic fuses."""
    from kernel_checks import fp8_qkv_rope_fused_vs_unfused

    for T in range(1, tactic.as_dict()["max_m"] + 1):
        fp8_qkv_rope_fused_vs_unfused(tactic, T, 32, 8, 128, torch.float8_e4m3fn,
                                      bias=T % 2 == 0, exact=False, device=DEV, K=4096)  # fmt: skip


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_norm_folded_into_the_gemvs(T, use_pdl):
    """plugins/gemm/fused_norm.py on the GPU: the GEMV adding into the residual stream gives
    the add + RMSNorm kernel's residual bits, the next GEMV normalizing as it loads matches
    the unfused chain (tests/fused_norm_checks.py), at the Llama o -> gate_up shapes."""
    from fused_norm_checks import add_out_then_norm_in

    add_out_then_norm_in(T, 4096, 4096, DEV, use_pdl)


def test_norm_folding_edge_cases():
    from fused_norm_checks import (
        fallbacks_match,
        fp8_norm_in_quantizes_after_the_norm,
        large_sums_take_the_coarse_sum,
        qkv_rope_norm_in,
        sums_do_not_depend_on_the_programs,
        swiglu_down_adds,
    )

    sums_do_not_depend_on_the_programs(DEV)
    large_sums_take_the_coarse_sum(DEV)
    fallbacks_match(DEV)
    for T in (1, 2):
        swiglu_down_adds(T, DEV)
        fp8_norm_in_quantizes_after_the_norm(T, DEV)
        qkv_rope_norm_in(T, DEV)
        qkv_rope_norm_in(T, DEV, fp8=True)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_w4a16_gemvs_fold_the_norms(packed, use_pdl):
    """INT4: the W4A16 GEMVs (fp32 and packed kernels) adding into the residual stream give
    the add + RMSNorm kernel's residual bits (o, and down with SwiGLU inside), the next one
    normalizing as it loads matches the unfused chain (tests/fused_norm_checks.py)."""
    from fused_norm_checks import w4a16_folds

    for T in (1, 2):
        w4a16_folds(T, DEV, packed, use_pdl)
