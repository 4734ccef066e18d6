"""What the FP8-cache prefill attention kernel compiles to on sm_90, with and without
`fp8_queries` (Q.K on FP8 tensor cores), compiled on this machine without a GPU: its MMAs by
operand type, the FP8 -> fp16 conversions, the shared-memory traffic and the registers.

Without fp8_queries every K and V element is staged in shared memory, read back, converted to
fp16 and stored again for the fp16 MMAs; with it K goes to the e4m3 MMAs as staged and only V
is converted. Llama-3.1-8B shapes (head dim 128, 32-token blocks, V transposed per block).

    python3 scripts/sass_prefill.py [--out sass_prefill.json]
"""

from __future__ import annotations

import re

from sass_report import cli, compile_sm90, kernel_source, resources
from triton.compiler import ASTSource

from ingot.plugins.attention import triton_prefill as pf

HD, BS = 128, 32
# the tactic the H100 build of 2026-12-06 picked for 2,048-token prompts, a wide one, and two
# tactics with their read-ahead twins (each tile's block-table entries read a tile ahead: two
# K/V tiles in flight), of 32-key tiles (a block each) and of 64 (two blocks each)
TACTICS = ("m64_n64_w4_s2", "m128_n64_w8_s2", "m64_n32_w4_s3", "m64_n32_w4_s3_a",
           "m64_n64_w4_s3", "m64_n64_w4_s3_a")  # fmt: skip
PTX_COUNTS = {
    "wgmma_e4m3": r"wgmma\.mma_async\S*e4m3",
    "wgmma_f16": r"wgmma\.mma_async\S*f16\.f16",
    "cvt_e4m3_to_f16": r"cvt\.rn\.f16x2\.e4m3x2",
    "st_shared": r"st\.shared",
    "ld_shared": r"ld\.shared",
}


def _source(fp8_qk: bool, block_m: int, block_n: int, bt_ahead: bool = False) -> ASTSource:
    fn = pf._prefill_kernel
    ptrs = {"q_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "ks_ptr": "*fp32",
            "vs_ptr": "*fp32", "bt_ptr": "*i32", "ctx_ptr": "*i32", "qsl_ptr": "*i32",
            "out_ptr": "*bf16"}  # fmt: skip
    const = {"HD": HD, "BS": BS, "V_T": True, "USE_WINDOW": False, "IEEE": False, "KV_FP8": True,
             "BLOCK_M": block_m, "BLOCK_N": block_n, "D_PAD": HD, "PDL": False, "PACK": 1,
             "QUANT_OUT": False, "SKIP_SINGLE": fp8_qk, "FP8_QK": fp8_qk,
             "BT_AHEAD": bt_ahead}  # fmt: skip
    return kernel_source(fn, ptrs, const)


def _kv_buffers(ttgir: str) -> int:
    """How many FP8 K/V tiles the pipeliner keeps in shared memory at once (the largest leading
    dimension of the kernel's FP8 [N, BLOCK_N, HD] buffers, [N, blocks, BS, HD] for tiles of
    several blocks): 1 means one tile in flight."""
    dims = re.findall(r"local_alloc[^\n]*memdesc<(\d+)x\d+x\d+(?:x\d+)?xf8E4M3FN", ttgir)
    return max(map(int, dims), default=0)


def report(tactics=TACTICS, fp8_queries=(False, True)) -> list[dict]:
    """One row per tactic and fp8_queries setting (as the engines' mixed steps launch it)."""
    rows = []
    for t in (x for x in pf.PREFILL_TACTICS if x.name in tactics):
        p = t.as_dict()
        for fp8_qk in fp8_queries:
            k = compile_sm90(
                _source(fp8_qk, int(p["block_m"]), int(p["block_n"]), bool(p.get("bt_ahead"))),
                num_warps=int(p["num_warps"]),
                num_stages=int(p["num_stages"]),
            )
            row = {"tactic": t.name, "fp8_queries": fp8_qk, "shared_bytes": k.metadata.shared,
                   "kv_buffers": _kv_buffers(k.asm["ttgir"])}  # fmt: skip
            row |= {n: len(re.findall(pat, k.asm["ptx"])) for n, pat in PTX_COUNTS.items()}
            row |= resources(k.asm["cubin"])
            rows.append(row)
            print(" ".join(f"{key}={val}" for key, val in row.items()))
    return rows


if __name__ == "__main__":
    cli(__doc__, report)
