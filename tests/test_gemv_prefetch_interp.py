"""The PDL variant of the decode GEMV loads its first 1, 2 or 4 weight chunks before its wait
(plugins/gemm/cuda.py: prefetch_chunks); run by Triton's interpreter on the CPU it must give
the plain variant's bits for K shorter than, equal to and longer than the chunks it prefetches
(plain, SwiGLU-gated, FP8 with x quantized on load, and the QKV GEMV with RoPE).

NOTE: TRITON_INTERPRET must be set before the kernel modules are imported, so the suite's one
test re-runs this module in a fresh process with the interpreter on.
"""

from __future__ import annotations

import os

import pytest
from interp_rerun import rerun_with_interpreter

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_gemv_prefetch_in_the_triton_interpreter():
        rerun_with_interpreter(__file__)

    def test_prefetch_chunks_fit_registers_and_k():
        pytest.importorskip("triton")
        from ingot.plugins.gemm import cuda

        o_proj = {"block_n": 4, "block_k": 1024, "num_warps": 4}  # 64 bytes per thread a chunk
        assert cuda.prefetch_chunks(4096, 2, o_proj) == 4
        assert cuda.prefetch_chunks(3072, 2, o_proj) == 2  # a 4th chunk would be all past K
        assert cuda.prefetch_chunks(1024, 2, o_proj) == 1
        wide = {"block_n": 8, "block_k": 2048, "num_warps": 8}  # 128 bytes a chunk
        assert cuda.prefetch_chunks(14336, 2, wide) == 2
        old = cuda.PREFETCH_BYTES
        try:
            cuda.PREFETCH_BYTES = 0
            assert cuda.prefetch_chunks(14336, 2, o_proj) == 1
        finally:
            cuda.PREFETCH_BYTES = old

else:
    import torch
    import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
    from kernel_checks import qkv_rope_fused_vs_unfused

    from ingot.plugins import pdl
    from ingot.plugins.gemm import cuda
    from ingot.plugins.gemm.qkv_rope import QKV_ROPE_TACTICS
    from ingot.plugins.quant.cuda_fp8 import make_fp8_swiglu_linear

    F8 = torch.float8_e4m3fn
    TACTIC = cuda.gemv_tactic(2, 512, 2, 1, max_m=2)  # small chunks: several per short K

    @pytest.fixture(autouse=True)
    def _prefetch_up_to_four():
        old = cuda.PREFETCH_BYTES
        cuda.PREFETCH_BYTES = 1 << 12
        yield
        cuda.PREFETCH_BYTES = old

    def _both(fn):
        plain = fn()
        with pdl.scope(True):
            return plain, fn()

    # K: inside chunk 0, 1.5 chunks (prefetch 2, the second partly past K), 3 (prefetch 2 +
    # the loop), 4.5 (prefetch 4 + the tail), 6 (prefetch 4 + the loop)
    @pytest.mark.parametrize("K,pre", [(96, 1), (768, 2), (1536, 2), (2304, 4), (3072, 4)])
    @pytest.mark.parametrize("T", [1, 2])
    def test_pdl_gemv_same_bits_as_plain(K, pre, T):
        assert cuda.prefetch_chunks(K, 2, TACTIC.as_dict()) == pre
        gen = torch.Generator().manual_seed(K + T)
        x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
        w = (torch.randn(40, K, generator=gen) * K**-0.5).to(torch.bfloat16)
        gate_up = torch.randn(T, 2 * K, generator=gen).to(torch.bfloat16)
        linear, swiglu_linear = cuda.make_linear(TACTIC), cuda.make_swiglu_linear(TACTIC)
        plain, again = _both(lambda: linear(x, w))
        assert torch.equal(plain, again)
        ref = x.float() @ w.float().t()
        assert (plain.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
        plain, again = _both(lambda: swiglu_linear(gate_up, w))
        assert torch.equal(plain, again)

    @pytest.mark.parametrize("K", [1024, 3072, 4608])
    def test_pdl_fp8_gemv_same_bits_as_plain(K):
        # FP8 weights (16 per 16-byte load): a 2-warp chunk is 1,024 wide
        tactic = cuda.gemv_tactic(2, 1024, 2, 1, max_m=1)
        gen = torch.Generator().manual_seed(K)
        gate_up = torch.randn(1, 2 * K, generator=gen).to(torch.bfloat16)
        w = (torch.randn(24, K, generator=gen) * 0.5).to(F8)
        ws, xs = torch.tensor(0.01), torch.tensor(0.02)
        fn = make_fp8_swiglu_linear(tactic)
        plain, again = _both(lambda: fn(gate_up, w, ws, xs))
        assert torch.equal(plain, again)
        assert plain.abs().max() > 0

    @pytest.mark.parametrize("K", [192, 1536])
    def test_pdl_qkv_rope_same_bits_as_plain(K):
        tactic = next(t for t in QKV_ROPE_TACTICS if t.as_dict()["block_n"] == 2)
        plain = qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, torch.bfloat16, K=K)
        with pdl.scope(True):
            again = qkv_rope_fused_vs_unfused(tactic, 1, 4, 2, 16, torch.bfloat16, K=K)
        for a, b in zip(plain["fused"], again["fused"], strict=True):
            assert torch.equal(a, b)
