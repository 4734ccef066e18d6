"""scripts/sass_report.py on the CPU: the decode kernel compiled for sm_90 with Triton's ptxas,
its registers read back with cuobjdump. Also a guard for the throughput path: the one-warp
large-batch decode kernel of FP8 engines must not spill to local memory."""

from __future__ import annotations

import pytest
from scripts_import import load_script

pytest.importorskip("triton")


def _script(name: str = "sass_report"):
    return load_script(name)


def test_large_batch_fp8_decode_kernel_fits_in_registers():
    mod = _script()
    from ingot.plugins.attention import triton_decode as dec

    large = next(t for t in dec.DECODE_TACTICS if t.name == "p128_n32_w1_s3_t4096")
    (row,) = mod.report(tactics=(large,), caches=("fp8",), new_v=(False,))
    assert row["stack"] == 0, row  # no spills in the loop that reads the whole KV cache
    assert row["instructions"] > 1000, row
    # 164 registers today: 12 one-warp programs per SM hide the cache's latency (H200, 89.8%
    # of the copy bandwidth at batch 128 x 3,072 keys); fewer than 10 would show there
    assert row["programs_per_sm_by_registers"] >= 10, row


def test_block_table_read_ahead_gives_the_fp8_decode_loop_two_tiles_in_flight():
    """bt_ahead: with each tile's block-table entry read a tile ahead, Triton's pipeliner
    double-buffers the one-warp FP8 decode loop's K and V (num_stages 3: 20 KB of shared
    memory, two 4 KB tiles each) where it kept one buffer (12 KB); no spills, and registers
    still allow 12 programs an SM (shared memory then allows 10)."""
    mod = _script()
    from ingot.plugins.attention import triton_decode as dec

    plain, ahead = (next(t for t in dec.DECODE_TACTICS if t.name == n) for n in
                    ("p512_n32_w1_s3_t8192_m512", "p512_n32_w1_s3_t8192_m512_a"))  # fmt: skip
    rows = mod.report(tactics=(plain, ahead), caches=("fp8",), new_v=(False,))
    by = {r["tactic"]: r for r in rows}
    assert by[plain.name]["shared_bytes"] <= 12_300 < 20_000 <= by[ahead.name]["shared_bytes"]
    assert by[ahead.name]["stack"] == 0 and by[ahead.name]["programs_per_sm_by_registers"] >= 12


def test_loop_spills_counts_local_memory_inside_backward_branches():
    mod = _script()
    sass = """
        /*0010*/                   STL [R1+0x4], R2 ;
        /*0020*/                   LDG.E R4, [R2.64] ;
        /*0030*/                   LDL.LU R5, [R1+0x4] ;
        /*0040*/              @!P1 BRA 0x20 ;
        /*0050*/                   LDL R6, [R1] ;
        /*0060*/                   BRA 0x60;
    """
    assert mod.loop_spills(sass) == 1  # 0x30 in the loop 0x20-0x40; 0x10 and 0x50 outside


def test_packed_w4a16_gemv_loop_takes_fewer_instructions_per_weight():
    """scripts/sass_w4a16.py: the packed (bf16x2) W4A16 GEMV's K loop issues at most 3.2 sm_90
    instructions per weight (2.91 today), the fp32 one's 4.36: what the packed kernel is for
    (at 4 bits a weight, DRAM-bound needs about 3.5 or fewer)."""
    mod = _script("sass_w4a16")
    from ingot.plugins.quant import triton_w4a16 as tw

    fp32 = next(t for t in tw.DECODE_TACTICS if not t.name.endswith("_p"))
    packed = next(t for t in tw.DECODE_TACTICS if t.name.endswith("_p"))
    per_weight, ops = {}, {}
    for t in (fp32, packed):
        p = t.as_dict()
        body, regs = mod.loop_body(mod.compile_gemv(p).asm["cubin"])
        per_weight[t.name] = len(body) / (p["block_n"] * p["block_g"] * 128 / (32 * p["num_warps"]))
        ops[t.name] = set(body)
        assert "BRA" in body and regs <= 168, (t.name, regs)
    assert per_weight[packed.name] <= 3.2 < 4.0 <= per_weight[fp32.name], per_weight
    assert "HFMA2.BF16_V2" in ops[packed.name] and "HFMA2.BF16_V2" not in ops[fp32.name]


def test_persistent_w4a16_gemv_programs_stay_resident():
    """scripts/sass_w4a16.py: each persistent W4A16 tactic's `persist` programs per SM fit in
    the SM's 64K registers in every variant an INT4 engine launches (plain, PDL, PDL with
    SwiGLU), so the grid is one wave; and its steady loop (two chunks, without the per-tile
    stores) issues within 10% of the plain kernel's instructions per weight at the same
    blocks (the prefetch costs addresses, not a second copy of the math)."""
    mod = _script("sass_w4a16")
    from ingot.plugins.quant import triton_w4a16 as tw

    persistent = [t for t in tw.DECODE_TACTICS if t.as_dict().get("persist")]
    assert persistent
    for t in persistent:
        p = t.as_dict()
        for variant in ({}, {"PDL": 2}, {"PDL": 2, "GATED": True}):
            _, regs = mod.loop_body(mod.compile_gemv(p, **variant).asm["cubin"])
            assert regs * 32 * p["num_warps"] * p["persist"] <= 65536, (t.name, variant, regs)
    per_weight = {r["tactic"]: r["per_weight"] for r in mod.report()}
    for t in persistent:
        plain = t.name.removesuffix(f"_r{t.as_dict()['persist']}")
        if plain in per_weight:
            assert per_weight[t.name] <= 1.1 * per_weight[plain], (t.name, per_weight)


def test_fp8_queries_prefill_runs_qk_on_fp8_mmas():
    """scripts/sass_prefill.py: with fp8_queries the FP8-cache prefill kernel's Q.K MMAs take
    e4m3 operands (K as staged from the cache) and only V is converted to fp16, half the
    conversions and fewer shared-memory stores, without spilling; without it no e4m3 MMA."""
    mod = _script("sass_prefill")
    rows = mod.report(tactics=("m64_n64_w4_s2",))
    plain, fp8 = (next(r for r in rows if r["fp8_queries"] is on) for on in (False, True))
    assert plain["wgmma_e4m3"] == 0 < fp8["wgmma_e4m3"], (plain, fp8)
    assert fp8["wgmma_f16"] < plain["wgmma_f16"], (plain, fp8)
    assert 2 * fp8["cvt_e4m3_to_f16"] == plain["cvt_e4m3_to_f16"] > 0, (plain, fp8)
    assert fp8["st_shared"] < plain["st_shared"] and fp8["stack"] == 0, (plain, fp8)


def test_v_segments_store_whole_windows_16_bytes_at_a_time():
    """The FP8 pool's V a window at a time (triton_kv_write._v_segments_kernel) compiled for
    sm_90: a whole window's dims go out in 16-byte stores (a run's partial window byte by
    byte). Which rows form a window is the kernel's runtime business (tests/v_segment_checks.py
    holds the bytes; the `step` benchmark's "packed runs" the speed)."""
    import re

    from ingot.plugins.attention import triton_kv_write as kv_write

    mod = _script()
    ptrs = {"v_ptr": "*bf16", "vc_ptr": "*fp8e4nv", "slot_ptr": "*i32", "vs_ptr": "*fp32"}
    const = {"BS": 32, "SEG": 32, "D_PAD": 128, "KV_FP8": True, "PDL": False}
    src = mod.kernel_source(kv_write._v_segments_kernel, ptrs, const)
    ptx = mod.compile_sm90(src, num_warps=4).asm["ptx"]
    stores = re.findall(r"st\.global\.[\w.]+", ptx)
    assert "st.global.v4.b32" in stores and "st.global.b8" in stores, sorted(set(stores))


def test_fp8mma_decode_experiment_runs_both_dots_on_fp8_wgmma():
    """plugins/attention/triton_decode_fp8mma.py compiled for sm_90 at Llama-3.1-8B shapes (a
    GQA group of 4, head dim 128, 32-token blocks): both dots are e4m3 wgmma (the reason for
    the swapped operands; an M of 16 would upcast to fp16 mma.sync), without spilling; the
    whole tiles' V^T loads are 16-byte vectors (the tail tile's, byte by byte)."""
    import re

    from ingot.plugins.attention import triton_decode_fp8mma as f8mma

    mod = _script()
    ptrs = {"q_ptr": "*bf16", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "ks_ptr": "*fp32",
            "vs_ptr": "*fp32", "bt_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*fp8e4nv"}  # fmt: skip
    const = {"BS": 32, "HD": 128, "G_PAD": 16, "BLOCK_N": 64, "QUANT_OUT": True,
             "TWO_TERM": True}  # fmt: skip
    ptrs["os_ptr"] = "*fp32"  # the FP8 o projection's input, as FP8 engines launch it
    src = mod.kernel_source(f8mma._decode_fp8mma_kernel, ptrs, const)
    k = mod.compile_sm90(src, num_warps=4)
    ptx = k.asm["ptx"]
    mmas = re.findall(r"wgmma\.mma_async[\w.]*", ptx)
    assert mmas and all(m.endswith(".e4m3.e4m3") for m in mmas), sorted(set(mmas))
    assert not re.search(r"mma\.sync", ptx)
    assert "ld.global.v4.b32" in ptx
    assert mod.resources(k.asm["cubin"])["stack"] == 0


def test_kernel_source_gives_constexprs_not_passed_their_defaults():
    """A kernel's constexpr with a default that a report does not pass compiles with the
    default, not as a runtime integer (which would compile both sides of its branches)."""
    mod = _script()
    from ingot.plugins.attention import triton_prefill as pf

    src = mod.kernel_source(pf._prefill_kernel, {"q_ptr": "*bf16"}, {"HD": 128})
    idx = pf._prefill_kernel.arg_names.index
    assert src.signature["FP8_QK"] == "constexpr" and src.signature["HD"] == "constexpr"
    assert src.constants[(idx("FP8_QK"),)] is False and src.constants[(idx("HD"),)] == 128
    assert src.signature["G"] == "i32"  # a runtime argument stays one


def test_block_table_read_ahead_gives_the_fp8_prefill_loop_two_tiles_in_flight():
    """bt_ahead in the prefill kernel over the bench engines' 32-token blocks, with 32-key tiles
    (a block each) and 64-key ones (two blocks each, K loaded a block at a time): Triton's
    pipeliner keeps two FP8 K/V tiles in shared memory where it kept one, without spilling."""
    mod = _script("sass_prefill")
    names = ("m64_n32_w4_s3", "m64_n32_w4_s3_a", "m64_n64_w4_s3", "m64_n64_w4_s3_a")
    rows = mod.report(tactics=names, fp8_queries=(False,))
    by = {r["tactic"]: r for r in rows}
    for plain_name in names[::2]:
        plain, ahead = by[plain_name], by[plain_name + "_a"]
        assert plain["kv_buffers"] == 1 < 2 == ahead["kv_buffers"], (plain, ahead)
        assert ahead["stack"] == 0 and ahead["reg"] <= 232, ahead
