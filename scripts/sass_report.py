"""Registers, local memory (spills), shared memory and instruction counts of the decode
attention kernel's sm_90 binaries, compiled on this machine without a GPU (Triton's ptxas and
cuobjdump): the engines' decode tactics with a BF16 or an FP8 cache, with and without new_v.

A check before spending GPU time on a kernel change: registers per thread bound how many
programs an SM holds (65,536 per SM), and with them how much memory latency the decode loop
can hide. Llama-3.1-8B shapes (GQA group 4, head dim 128, 32-token blocks).

    python3 scripts/sass_report.py [--out sass_report.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ingot.plugins.attention import triton_decode as dec

G, HD, BS = 4, 128, 32
# the tactics engines pick: the default, wide tiles, and the one- and two-warp large-batch ones
TACTICS = (dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[4], *dec.LARGE_BATCH_TACTICS)
# runtime integers the launcher passes that Triton specializes as multiples of 16
_STRIDES = ("sqt", "sqh", "sot", "soh", "s_blk", "s_tok", "s_h", "s_bt", "snt", "snh",
            "svt", "svh", "sv_blk", "sv_h")  # fmt: skip
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _source(
    fp8: bool, new_v: bool, block_n: int, num_warps: int, split_min: int, qsl_rows: bool = False,
    bt_ahead: bool = False,
) -> ASTSource:  # fmt: skip
    fn = dec._decode_kernel
    cache = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = {"q_ptr": "*bf16", "kc_ptr": cache, "vc_ptr": cache, "bt_ptr": "*i32",
            "ctx_ptr": "*i32", "out_ptr": "*fp8e4nv" if fp8 else "*bf16", "po_ptr": "*fp32",
            "pml_ptr": "*fp32", "cnt_ptr": "*i32"}  # fmt: skip
    const = {"HD": HD, "BS": BS, "V_T": fp8, "SPLIT": True, "USE_WINDOW": False, "IEEE": False,
             "KV_FP8": fp8, "BLOCK_N": block_n, "G_PAD": 16, "D_PAD": HD, "G_POW2": G,
             "MERGE_SPLITS": dec.merge_splits(G, HD, num_warps), "PDL": False,
             "QUANT_OUT": fp8, "WRITE_V": new_v, "SEG": 32, "SPLIT_MIN": split_min,
             "QSL_ROWS": qsl_rows, "BT_AHEAD": bt_ahead}  # fmt: skip
    if fp8:  # scales: an FP8 cache's and the FP8 o projection's input
        ptrs |= {"ks_ptr": "*fp32", "vs_ptr": "*fp32", "os_ptr": "*fp32"}
    if new_v:
        ptrs["nv_ptr"] = "*bf16"
    if qsl_rows:  # a graph of a step with prompts: its decodes found from the query offsets
        ptrs["qsl_ptr"] = "*i32"
    return kernel_source(fn, ptrs, const)


def kernel_source(fn, ptrs: dict[str, str], const: dict) -> ASTSource:
    """An attention kernel's launch as a compile source: pointers of the given types, the
    constexprs given (the others their defaults), every other pointer None, scale_log2 fp32
    and the other scalars int32; pointers and strides 16-divisible, as the launchers'
    tensors are."""
    const, sig = dict(const), {}
    # constexprs not given take their defaults (a new one must not become a runtime int)
    const |= {p.name: p.default for p in fn.params
              if p.is_constexpr and p.has_default and p.name not in const}  # fmt: skip
    for a in fn.arg_names:
        if a in const:
            sig[a] = "constexpr"
        elif a in ptrs:
            sig[a] = ptrs[a]
        elif a.endswith("_ptr"):  # an argument this build passes as None
            sig[a], const[a] = "constexpr", None
        else:
            sig[a] = "fp32" if a == "scale_log2" else "i32"
    idx = fn.arg_names.index
    divisible = [a for a in (*ptrs, *_STRIDES) if a in fn.arg_names]
    attrs = {(idx(a),): [["tt.divisibility", 16]] for a in divisible}
    return ASTSource(fn, sig, {(idx(k),): v for k, v in const.items()}, attrs)


def compile_sm90(src: ASTSource, **options):
    """`src` compiled for sm_90 (H100/H200) with Triton's own ptxas: no GPU needed."""
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(cubin: bytes, *flags: str) -> list[str]:
    """cuobjdump's output for `cubin` under each flag (e.g. "-sass", "--dump-resource-usage")."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return [subprocess.run([str(_BIN / "cuobjdump"), flag, str(path)],
                               capture_output=True, text=True, check=True).stdout
                for flag in flags]  # fmt: skip


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """Each SASS instruction's address and text (predicate, opcode, operands)."""
    return [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def branch_target(op: str) -> int | None:
    """The address a branch instruction jumps to; None for any other instruction."""
    to = re.search(r"BRA .*?0x([0-9a-f]+)", op)
    return int(to.group(1), 16) if to else None


def opcode(op: str) -> str:
    """An instruction's opcode, past its predicate."""
    return op.split()[1] if op.startswith("@") else op.split()[0]


def loops(instrs: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) address of each loop: a backward branch's target and the branch."""
    return [(t, a) for a, op in instrs if (t := branch_target(op)) is not None and t < a]


def loop_spills(sass: str) -> int:
    """Local-memory loads and stores (LDL/STL: spills) inside a loop: between a backward
    branch's target and the branch. Spills outside the loops cost once a program."""
    instrs = sass_instructions(sass)
    spans = loops(instrs)
    return sum(any(lo <= a <= hi for lo, hi in spans) for a, op in instrs
               if opcode(op).startswith(("LDL", "STL")))  # fmt: skip


def resources(cubin: bytes) -> dict:
    """REG / STACK / SHARED per cuobjdump, the SASS instruction count and the spills inside
    loops."""
    usage, sass = cuobjdump(cubin, "--dump-resource-usage", "-sass")
    out = {k.lower(): int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK")}
    out["instructions"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/ ", sass))
    out["loop_spills"] = loop_spills(sass)
    return out


def report(
    tactics=TACTICS, caches=("bf16", "fp8"), new_v=(False, True), qsl_rows=(False,)
) -> list[dict]:
    """qsl_rows=(False, True) also compiles each decode kernel as the prefill graphs of several
    sequences launch it (QSL_ROWS, without new_v)."""
    rows = []
    combos = [(nv, False) for nv in new_v] + [(False, True) for q in qsl_rows if q]
    for tactic in tactics:
        p = tactic.as_dict()
        warps, stages = int(p["num_warps"]), int(p["num_stages"])
        for cache in caches:
            for nv, qr in combos:
                block_n = min(int(p["block_n"]), int(p["partition"]))
                src = _source(cache == "fp8", nv, block_n, warps,
                              dec.split_min_keys(p, block_n), qr, bool(p.get("bt_ahead")))  # fmt: skip
                k = compile_sm90(src, num_warps=warps, num_stages=stages)
                row = {"tactic": tactic.name, "cache": cache, "new_v": nv, "qsl_rows": qr,
                       "shared_bytes": k.metadata.shared, **resources(k.asm["cubin"])}  # fmt: skip
                # programs per SM the registers allow (allocated per warp in units of 256)
                per_warp = -(-row["reg"] * 32 // 256) * 256
                row["programs_per_sm_by_registers"] = 65536 // (per_warp * warps)
                rows.append(row)
                print(f"{tactic.name:24s} {cache:5s} new_v={nv!s:5s} qsl={qr!s:5s} "
                      f"regs {row['reg']:3d} "
                      f"stack {row['stack']:4d} (in loops {row['loop_spills']}) "
                      f"smem {row['shared_bytes']:6d} "
                      f"sass {row['instructions']:5d} -> {row['programs_per_sm_by_registers']} "
                      "programs/SM")  # fmt: skip
    return rows


def cli(doc: str, make_rows) -> None:
    """Parse --out, print the rows `make_rows()` gives, and write them as JSON there."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = make_rows()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


def main() -> None:
    cli(__doc__, lambda: report(qsl_rows=(False, True)))


if __name__ == "__main__":
    main()
