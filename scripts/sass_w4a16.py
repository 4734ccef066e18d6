"""Instructions per weight in the main loop of the W4A16 decode GEMV's sm_90 binaries, compiled
on this machine without a GPU (Triton's ptxas and cuobjdump): every decode tactic, the fp32
kernel, the packed (bf16x2) one, the persistent one and the tensor-core one (and its medium-batch
tactics with 2 or 4 x tiles), at
Llama-3.1-8B's qkv shape with AWQ's pre_quant_scale.

A check before spending GPU time: at 4 bits a weight the H200 leaves ~3.5 issue slots per
weight for a GEMV to stay bound by DRAM (scripts/bench_w4a16.py then times them).

    python3 scripts/sass_w4a16.py [--out sass_w4a16.json]
"""

from __future__ import annotations

import collections
import re

import triton
from sass_report import (
    branch_target,
    cli,
    compile_sm90,
    cuobjdump,
    loops,
    opcode,
    sass_instructions,
)
from triton.compiler import ASTSource

from ingot.plugins.quant import triton_w4a16 as tw
from ingot.plugins.quant import w4a16_mma as wm
from ingot.plugins.quant import w4a16_persistent as wp

_PTRS = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "pqs_ptr": "*bf16",
         "b_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip


def compile_gemv(params: dict, pqs: bool = True, kb: int = 32, **variant):
    """The decode GEMV of tactic `params` for sm_90; variant: constexprs set (PDL=2,
    GATED=True, ...), the others at their defaults."""
    persist = bool(params.get("persist"))  # the resident-program kernel (no STAGES)
    fn = wp._w4a16_gemv_persistent_kernel if persist else tw._w4a16_gemv_kernel
    const = {"PACKED": bool(params.get("packed")), "HAS_PQS": pqs, "HAS_BIAS": False, "BLOCKS_PER_GROUP": 1,
             "BLOCK_M": triton.next_power_of_2(int(params["max_m"])),
             "BLOCK_N": params["block_n"], "BLOCK_G": params["block_g"],
             "MASKED": kb % params["block_g"] != 0}  # fmt: skip
    if not persist:
        const["STAGES"] = params["num_stages"]
    const |= variant
    opts = {"num_warps": params["num_warps"], "num_stages": params["num_stages"]}
    return _compile(fn, const, opts)


def _compile(fn, const: dict, opts: dict):
    """`fn` for sm_90 with these constexprs, every other at its default (GATED, PDL, ...:
    off), never a runtime argument; pointers 16-byte aligned, KB and the strides too."""
    const = const | {q.name: q.default for q in fn.params if q.is_constexpr and q.name not in const}
    sig = {a: "constexpr" if a in const else _PTRS.get(a, "i32") for a in fn.arg_names}
    idx = fn.arg_names.index
    attrs = {(idx(a),): [["tt.divisibility", 16]] for a in (*_PTRS, "KB", "sxm", "som")}
    src = ASTSource(fn, sig, {(idx(k),): v for k, v in const.items()}, attrs)
    return compile_sm90(src, **opts)


def loop_body(cubin: bytes, steady: bool = False) -> tuple[list[str], int]:
    """The SASS opcodes between the last backward branch and its target (the K loop) and the
    registers per thread. steady: without the blocks a forward branch inside the loop can
    skip (the persistent kernel's per-tile stores: once a tile, not once a step)."""
    sass, usage = cuobjdump(cubin, "-sass", "--dump-resource-usage")
    instrs = sass_instructions(sass)
    lo, hi = loops(instrs)[-1]
    skipped = set()
    for a, op in instrs if steady else ():
        to = branch_target(op)
        if to is not None and lo <= a <= hi and to > a:
            skipped |= {b for b, _ in instrs if a < b < to}
    body = [opcode(op) for a, op in instrs if lo <= a <= hi and a not in skipped]
    return body, int(re.search(r"REG:(\d+)", usage).group(1))


def compile_mma(params: dict, pqs: bool = True):
    """The tensor-core GEMV of an `mma` tactic for sm_90 (w4a16_mma.py)."""
    warps = params["mma_warps"]
    const = {"HAS_PQS": pqs, "HAS_BIAS": False, "BLOCKS_PER_GROUP": 1, "WARPS": warps,
             "TILES": params["tiles"], "UNROLL": params["unroll"],
             "PREFETCH": bool(params.get("prefetch")), "XTILES": params.get("xtiles", 1)}  # fmt: skip
    return _compile(wm._w4a16_mma_gemv_kernel, const, {"num_warps": warps})


def report() -> list[dict]:
    rows = []
    # the decode tactics, then the medium-batch ones on the tensor cores (2 or 4 x tiles)
    for tactic in (*tw.DECODE_TACTICS, *(t for t in tw.MID_TACTICS if t.as_dict().get("mma"))):
        p = tactic.as_dict()
        if p.get("mma"):  # a thread's weights an iteration: its tiles' 16 rows x 128 k / 32
            body, regs = loop_body(compile_mma(p).asm["cubin"])
            weights = p["tiles"] * p["unroll"] * 64
            rows.append({"tactic": tactic.name, "registers": regs, "loop_instructions": len(body),
                         "per_weight": len(body) / weights, "ops": dict(collections.Counter(body))})  # fmt: skip
            print(
                f"{tactic.name:28s} regs {regs:3d} loop {len(body):5d} {len(body) / weights:5.2f}/weight"
            )
            continue
        # the persistent kernel's loop: two steps (chunks), and a tile's store when one ends
        steps = 2 if p.get("persist") else 1
        body, regs = loop_body(compile_gemv(p).asm["cubin"], steady=steps == 2)
        weights = p["block_n"] * p["block_g"] * 128 * steps / (32 * p["num_warps"])  # a thread's
        ops = collections.Counter(body)
        top = ops.most_common(6)
        rows.append({"tactic": tactic.name, "registers": regs, "loop_instructions": len(body),
                     "per_weight": len(body) / weights, "top": top, "ops": dict(ops)})  # fmt: skip
        print(f"{tactic.name:28s} regs {regs:3d} loop {len(body):5d} "
              f"{len(body) / weights:5.2f}/weight  {top[:4]}")  # fmt: skip
    return rows


def main() -> None:
    cli(__doc__, report)


if __name__ == "__main__":
    main()
