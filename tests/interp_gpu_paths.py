"""Run with TRITON_INTERPRET=1 (tests/test_gpu_paths_interp.py does): the GPU engine's code
paths — the Triton plugins, the decode and prefill CUDA-graph runners with their padding and
scratch block — executed on the CPU, against the CPU reference engine, token for token.

CUDA graphs cannot exist on the CPU, so capture is replaced by recording: `replay()` re-runs
the captured call into the captured output tensors. Everything else is the real code.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import tempfile
from pathlib import Path

import torch
import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
from recorded_graphs import record_graphs
from reference_runs import random_prompts

import ingot.runtime.cuda_graphs as cg


class _Counted:
    """A Triton kernel whose launches (`kernel[grid](...)`) are counted into `calls`."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def check_swiglu_gemv() -> None:
    """The decode GEMV with SwiGLU fused into its loads equals SwiGLU then GEMV; its PDL
    variant (K = 96 < BLOCK_K: the chunk loaded before the wait is all of K) the same bits."""
    from ingot.plugins import pdl
    from ingot.plugins.activation.triton_kernels import make_swiglu
    from ingot.plugins.gemm.cuda import GEMM_TACTICS, make_linear, make_swiglu_linear

    torch.manual_seed(0)
    gemv = next(t for t in GEMM_TACTICS if t.as_dict().get("max_m", 0) >= 2)
    for t in (1, 2):
        gate_up = torch.randn(t, 2 * 96, dtype=torch.float16)
        w = torch.randn(40, 96, dtype=torch.float16)
        act = make_swiglu(None)(gate_up)
        fused = make_swiglu_linear(gemv)(gate_up, w)
        unfused = make_linear(gemv)(act, w)
        assert torch.equal(fused, unfused), (fused - unfused).abs().max()
        with pdl.scope(True):
            assert torch.equal(make_swiglu_linear(gemv)(gate_up, w), fused)
            assert torch.equal(make_linear(gemv)(act, w), unfused)
        ref = act.float() @ w.float().t()
        assert (unfused.float() - ref).abs().max() <= 1e-3 * ref.abs().max()


def _kept(into: list, make, *args):
    """make(*args), appended to `into` too."""
    into.append(make(*args))
    return into[-1]


def check_folded_norms(family: str, root: Path) -> None:
    """A half-precision engine on the GPU plugins with the norms folded into the decode GEMVs
    (plugins/gemm/fused_norm.py): batch-1 decode steps give the hidden states and KV cache of
    the same decoder with them unfolded, within fp16 rounding; larger batches do not fold.
    NOTE: fp16, not bf16: the interpreter's decode attention over a bf16 cache returned
    values ~1e9 times the reference's (bf16 dots), with or without the norms folded."""
    from kernel_checks import rel_err

    from ingot.compiler.build import build_engine
    from ingot.compiler.convert import convert_checkpoint
    from ingot.compiler.examples import make_tiny_hf_model
    from ingot.compiler.tactic_select import default_choices
    from ingot.runtime import model as model_mod
    from ingot.runtime.engine import load_engine
    from ingot.runtime.kv_cache import KVCache
    from ingot.runtime.model import AttnMetadata, Decoder, Ops

    new_sums = model_mod.new_sums
    hf = make_tiny_hf_model(family, root / "hf16", seed=9)
    ckpt = convert_checkpoint(hf, root / "ckpt16", dtype="float16")
    build = {"max_batch_size": 4, "max_seq_len": 64, "tokens_per_block": 16}
    eng = load_engine(build_engine(ckpt, root / "eng16", target="cpu", overrides=build))
    m = eng.config.model
    cfg = dataclasses.replace(
        eng.config,
        build=dataclasses.replace(eng.config.build, target="sm_90", fused_norms=True),
        plugins=tuple(default_choices("sm_90", m)),
    )
    dec = Decoder(m, eng.weights(), Ops(cfg))
    assert dec.fold_rows >= 1 and dec._folded_layers(1) == m.num_layers - 1
    assert dec._folded_layers(dec.fold_rows + 1) == 0
    i32 = dict(dtype=torch.int32)
    kv = KVCache(m, 8, 16, torch.float16, torch.device("cpu"))
    kv.data.normal_()  # a cached context of random keys and values
    folded_rows = dec.fold_rows
    # a decode step: one query at position ctx - 1, its keys over three blocks. (One context:
    # the fold changes the GEMVs, not attention; each context took two interpreter forwards.)
    ctx = 33
    meta = AttnMetadata(torch.tensor([ctx - 1], **i32), torch.arange(4, **i32)[None],
                        torch.tensor([ctx], **i32), torch.tensor([0, 1], **i32), 64, 1,
                        num_decodes=1)  # fmt: skip
    ids, pos = torch.tensor([ctx % m.vocab_size], **i32), torch.tensor([ctx - 1], **i32)
    out, made = {}, []
    for rows in (folded_rows, 0):
        dec.fold_rows = rows
        cache = KVCache(m, 8, 16, torch.float16, torch.device("cpu"))
        cache.data.copy_(kv.data)
        try:
            model_mod.new_sums = functools.partial(_kept, made, new_sums)
            out[rows] = (dec.forward(ids, pos, meta, cache), cache.data)
        finally:
            model_mod.new_sums = new_sums
    # the folded pass ran: every o and down GEMV of the first L - 1 layers added its sums
    assert len(made) == 1 and made[0].shape == (2 * (m.num_layers - 1), 2, 1)
    assert (made[0][:, 0] > 0).all()
    (h1, c1), (h0, c0) = out[folded_rows], out[0]
    assert rel_err(h1, h0) < 2e-2, rel_err(h1, h0)
    assert rel_err(c1, c0) < 1e-2
    dec.fold_rows = folded_rows


def main(family: str, quant: str = "none", fold: str = "") -> None:
    """quant "fp8": an FP8 engine with an FP8 KV cache (the fused norm/SwiGLU quantization,
    the FP8 KV write and attention kernels; the GEMM's cuBLASLt call takes its CPU fallback);
    "int4_awq": the W4A16 GEMV (SwiGLU applied in the down GEMV) and GEMM kernels.
    fold "fold": the engine folds its norms into the decode GEMVs (fp32 weights: the GEMVs'
    fallback math), and a bf16 engine's folded decode steps are checked too."""
    from ingot.compiler.build import build_engine
    from ingot.compiler.convert import convert_checkpoint
    from ingot.compiler.examples import make_tiny_hf_model
    from ingot.compiler.quantize import QuantOptions
    from ingot.compiler.tactic_select import default_choices
    from ingot.plugins.quant import unused_plugins
    from ingot.runtime.engine import load_engine
    from ingot.runtime.executor import Executor
    from ingot.runtime.types import SamplingParams

    cg.capture_graphs = record_graphs
    root = Path(tempfile.mkdtemp())
    opts, sizes = None, {}
    if quant == "fp8":
        opts = QuantOptions("fp8", "fp8", calib_size=4, calib_max_seq_len=64, device="cpu")
    if quant == "int4_awq":  # K a multiple of the group size (128)
        opts = QuantOptions("int4_awq", calib_size=4, calib_max_seq_len=64, device="cpu")
        sizes = {"hidden_size": 128, "intermediate_size": 256}
    hf = make_tiny_hf_model(family, root / "hf", seed=5, **sizes)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32", quant=opts)
    build = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}
    cpu = load_engine(build_engine(ckpt, root / "cpu", target="cpu", overrides=build))
    m = cpu.config.model
    # the same weights, bound to the GPU plugins (default tactics) instead of the references
    unused = unused_plugins(cpu.config.quant.mode, cpu.config.quant.lm_head)
    choices = tuple(c for c in default_choices("sm_90", m) if c.name not in unused)
    if quant == "fp8":
        # the widest FP8 GEMV (a program per BLOCK_N weight rows: the default n2 one's programs
        # took ~90% of a batch-1 step's time under the interpreter, 4x those of this n8 one);
        # folded, the SwiGLU down takes it too (its default is unfused: a fused GEMV folds)
        from ingot.plugins.quant.cuda_fp8 import FP8_GEMM_TACTICS

        gemvs = [t for t in FP8_GEMM_TACTICS if t.as_dict().get("max_m")]
        gemv = max(gemvs, key=lambda t: t.as_dict()["block_n"])
        names = ("fp8_gemm", "fp8_swiglu_gemm") if fold else ("fp8_gemm",)
        choices = tuple(
            dataclasses.replace(c, tactic=gemv.name, params=gemv.as_dict())
            if c.name in names else c
            for c in choices
        )  # fmt: skip
    gpu_cfg = dataclasses.replace(
        cpu.config,
        build=dataclasses.replace(cpu.config.build, target="sm_90", fused_norms=bool(fold)),
        plugins=choices,
    )
    gpu = dataclasses.replace(cpu, config=gpu_cfg)
    prompts = random_prompts(m.vocab_size, seed=5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = [r.output_ids for r in Executor(cpu).generate(prompts, params)]

    ex = Executor(gpu, device=torch.device("cpu"), num_kv_blocks=64)
    # an FP8 pool's decode rows: V stored by the attention kernel (new_v), not by RoPE (an
    # option, off by default: runtime/model.py)
    # (unfolded only: the folded run takes the FP8 QKV GEMV with RoPE in its epilogue, which
    # stores V itself)
    ex.decoder.decode_writes_v = quant == "fp8" and not fold
    width = ex.scheduler.config.max_blocks_per_seq
    # a short tier at 32 keys: the lone short prompts' steps run it, the batch's the main one
    ex.graphs = cg.DecodeGraphs(ex.decoder, ex.kv, 8, width, 256, torch.device("cpu"), 32)
    assert ex.graphs.short_buckets == [1, 2, 4, 8]
    tiers = {"short": 0, "main": 0}
    for tier, graphs in (("short", ex.graphs.short_graphs), ("main", ex.graphs.graphs)):
        for g in graphs.values():
            g.replay = lambda _r=g.replay, _t=tier: tiers.__setitem__(_t, tiers[_t] + 1) or _r()
    # steps of up to 8 sequences with prompt tokens: the batch's first steps, a chunk beside
    # decodes
    keys = cg.prefill_graph_keys([16, 32, 64], 8)
    ex.prefill_graphs = cg.PrefillGraphs(ex.decoder, ex.kv, keys, width, torch.device("cpu"))
    assert ex.prefill_graphs.tiers == [1, 8]
    # an FP8 pool's prompt V goes in a segment of tokens at a time (rope.triton_kernels)
    from ingot.plugins.rope import triton_kernels as rope_gpu

    segments, write_segments = [], rope_gpu.write_v_segments
    rope_gpu.write_v_segments = lambda *a: segments.append(a[-1]) or write_segments(*a)
    # an INT4 engine's down GEMVs apply SwiGLU as they load x (plugins/quant/triton_w4a16.py)
    from ingot.plugins.quant import triton_w4a16 as tw

    w4_calls, launch_w4 = set(), tw.launch_w4a16  # (gated, norm folded in, add folded in)
    tw.launch_w4a16 = lambda *a: (
        w4_calls.add((a[9], a[10] is not None, a[11] is not None)) or (launch_w4(*a))
    )
    # quantized engines' QKV GEMV with RoPE in its epilogue (INT4: fp32 x runs it)
    from ingot.plugins.quant import w4a16_qkv_rope as wq

    w4_rope, launch_rope = [], wq._w4a16_qkv_rope_kernel
    wq._w4a16_qkv_rope_kernel = _Counted(launch_rope, w4_rope)
    used = {"decode": 0, "prefill": 0}
    for name, runner in (("decode", ex.graphs), ("prefill", ex.prefill_graphs)):

        def counted(plan, *ids, _run=runner.run, _name=name):
            used[_name] += 1
            return _run(plan, *ids)

        runner.run = counted
    steps = []  # (prompts, sequences) of each step in a prefill graph
    pg_run = ex.prefill_graphs.run
    ex.prefill_graphs.run = lambda plan, *a: (
        steps.append((plan.num_prefill, plan.num_seqs)) or pg_run(plan, *a)
    )
    batched = [r.output_ids for r in ex.generate(prompts, params)]
    # one prompt alone (the short tier, a tier-1 prefill graph): the 17-token one, whose
    # prompt spans two blocks and takes the 32-token bucket. (Three alone were half of the
    # slowest case's time under the interpreter: ~114 s each on the CI machine kind, with
    # another process beside it.)
    alone = ex.generate([prompts[2]], params)[0].output_ids
    assert batched == ref, (batched, ref)
    assert alone == ref[2], (alone, ref[2])
    assert used["decode"] > 0 and used["prefill"] >= 3, used
    assert tiers["short"] > 0 and tiers["main"] > 0, tiers
    assert any(p > 1 for p, _ in steps) and any(p < n for p, n in steps), steps
    assert ex.decoder.fp8_fused == ex.decoder.fp8_kv == (quant == "fp8")
    assert ex.decoder.fused_rope_kv  # RoPE + KV write in one kernel, FP8 cache included
    assert bool(segments) == (quant == "fp8"), segments
    # SwiGLU-quantize folded into the FP8 down GEMV where its tactic has a GEMV (the folded
    # run's), else that kernel then the FP8 GEMM (the default, cuBLASLt tactic's: unfused)
    assert (ex.decoder.fp8_swiglu_down is not None) == (quant == "fp8" and bool(fold))
    gated = {c for c in w4_calls if c[0]}
    assert bool(gated) == bool(w4_calls - gated) == (quant == "int4_awq"), w4_calls
    assert bool(w4_rope) == (quant == "int4_awq"), len(w4_rope)
    if quant == "int4_awq":  # folded: the o / down GEMVs add, the qkv / gate_up ones normalize
        assert ((True, False, True) in w4_calls) == ((False, True, False) in w4_calls) == bool(fold)
    check_swiglu_gemv()
    if fold:
        assert ex.decoder.fold_rows >= 1
        if quant != "int4_awq":
            check_folded_norms(family, root)
    print("ok", family, quant, fold, used)


if __name__ == "__main__":
    main(*sys.argv[1:])
