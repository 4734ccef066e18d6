"""The tensor-core W4A16 GEMV (plugins/quant/w4a16_mma.py) compiled for sm_90 on the CPU, as
an INT4 engine's AOT dry run records it. Its inline `mma.sync` runs once per tensor element
and takes each lane's registers as that lane's fragments, so it is right only if Triton keeps
element i of its [32 WARPS] operands on thread i: checked on the compiled TTGIR for every mma
tactic, with and without PDL (which prefetches the first weights into L2 before its wait). (The arithmetic is checked in the interpreter,
tests/test_quant_kernels_interp.py, and on a GPU, tests/test_gpu_quant.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from sm90 import compile_for_sm90

triton = pytest.importorskip("triton", reason="the GPU plugins are Triton kernels")

from ingot.compiler.kernel_bundle import recorded_launches  # noqa: E402
from ingot.plugins import pdl  # noqa: E402
from ingot.plugins.quant import triton_w4a16 as tw  # noqa: E402

# the decode ones, and the medium-batch ones with 2 or 4 x tiles
MMA = [t for t in (*tw.DECODE_TACTICS, *tw.MID_TACTICS) if t.as_dict().get("mma")]


def _compiled(tactic, tmp_path, use_pdl: bool, N: int = 6144, K: int = 4096):
    """The sm_90 kernel the tactic's launch records (Llama-3.1-8B's qkv) for as many x rows
    as one launch takes (1 for the decode tactics)."""
    meta = dict(device="meta")
    rows = tw.mma_rows(tactic.as_dict()) if tactic.as_dict().get("xtiles") else 1
    x = torch.empty(rows, K, dtype=torch.bfloat16, **meta)
    qweight = torch.empty(N, K // 8, dtype=torch.int32, **meta)
    scales = torch.empty(N, K // 128, dtype=torch.bfloat16, **meta)
    pqs = torch.empty(K, dtype=torch.bfloat16, **meta)
    fn = tw.make_w4a16_linear(tw.combine_tactics(tactic, tw.GEMM_TACTICS[0]))
    with recorded_launches() as specs, pdl.scope(use_pdl):
        fn(x, qweight, scales, pqs, 128)
    (spec,) = specs
    assert spec.fn.endswith(":_w4a16_mma_gemv_kernel")
    return compile_for_sm90(spec, tmp_path)


@pytest.mark.parametrize("use_pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("tactic", MMA, ids=lambda t: t.name)
def test_mma_operands_stay_one_element_a_thread(tactic, use_pdl, tmp_path):
    kernel = _compiled(tactic, tmp_path, use_pdl)
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    warps = tactic.as_dict()["mma_warps"]
    one_a_thread = (
        f"#ttg.blocked<{{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], "
        "order = [0]}>"
    )
    mmas = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "mma.sync" in line]  # fmt: skip
    tiles, xtiles = tactic.as_dict()["tiles"], tactic.as_dict().get("xtiles", 1)
    # a -136 chain and the tiles', for each x tile
    assert len(mmas) == 8 * (1 + tiles) * tactic.as_dict()["unroll"] * xtiles
    for line in mmas:
        types = re.findall(r"tensor<(\d+)x\w+, (#\w+)>", line)
        assert len(types) == 14, line  # 10 operands, 4 results
        assert all(int(n) == 32 * warps and layouts[name] == one_a_thread for n, name in types)
    ptx = kernel.asm["ptx"]
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == len(mmas)
    assert ("griddepcontrol.wait" in ptx) == use_pdl == ("prefetch.global.L2" in ptx)
    if use_pdl:  # the first pass's weights are asked for before the wait
        assert ptx.index("prefetch.global.L2") < ptx.index("griddepcontrol.wait")
    assert kernel.asm["cubin"]
