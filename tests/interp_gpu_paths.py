"""Run with TRITON_INTERPRET=1 (tests/test_gpu_paths_interp.py does): the GPU engine's code
paths — the Triton plugins, the decode and prefill CUDA-graph runners with their padding and
scratch block — executed on the CPU, against the CPU reference engine, token for token.

CUDA graphs cannot exist on the CPU, so capture is replaced by recording: `replay()` re-runs
the captured call into the captured output tensors. Everything else is the real code.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import torch
import triton_interp_compat  # noqa: F401  (Triton interpreter vs NumPy 2.4)
from reference_runs import random_prompts

import ingot.runtime.cuda_graphs as cg


class _Recorded:
    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _record_graphs(buckets, run, prepare=None):
    """Stands in for cuda_graphs.capture_graphs: `replay()` re-runs the call into the same
    output tensors, as a graph replay writes into its captured outputs."""
    graphs, outputs = {}, {}
    for b in reversed(buckets):
        if prepare is not None:
            prepare(b)
        outputs[b] = tuple(x.clone() for x in run(b))

        def again(b=b):
            results = run(b)
            for dst, src in zip(outputs[b], results, strict=True):
                dst.copy_(src)

        graphs[b] = _Recorded(again)
    return graphs, outputs


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


def main(family: str, quant: str = "none") -> None:
    """quant "fp8": an FP8 engine with an FP8 KV cache (the fused norm/SwiGLU quantization,
    the FP8 KV write and attention kernels; the GEMM's cuBLASLt call takes its CPU fallback)."""
    from ingot.compiler.build import build_engine
    from ingot.compiler.convert import convert_checkpoint
    from ingot.compiler.examples import make_tiny_hf_model
    from ingot.compiler.quantize import QuantOptions
    from ingot.compiler.tactic_select import default_choices
    from ingot.plugins.quant import unused_plugins
    from ingot.runtime.engine import load_engine
    from ingot.runtime.executor import Executor
    from ingot.runtime.types import SamplingParams

    cg.capture_graphs = _record_graphs
    root = Path(tempfile.mkdtemp())
    opts = None
    if quant == "fp8":
        opts = QuantOptions("fp8", "fp8", calib_size=4, calib_max_seq_len=64, device="cpu")
    hf = make_tiny_hf_model(family, root / "hf", seed=5)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32", quant=opts)
    build = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}
    cpu = load_engine(build_engine(ckpt, root / "cpu", target="cpu", overrides=build))
    m = cpu.config.model
    # the same weights, bound to the GPU plugins (default tactics) instead of the references
    unused = unused_plugins(cpu.config.quant.mode, cpu.config.quant.lm_head)
    gpu_cfg = dataclasses.replace(
        cpu.config,
        build=dataclasses.replace(cpu.config.build, target="sm_90"),
        plugins=tuple(c for c in default_choices("sm_90", m) if c.name not in unused),
    )
    gpu = dataclasses.replace(cpu, config=gpu_cfg)
    prompts = random_prompts(m.vocab_size, seed=5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = [r.output_ids for r in Executor(cpu).generate(prompts, params)]

    ex = Executor(gpu, device=torch.device("cpu"), num_kv_blocks=64)
    # an FP8 pool's decode rows: V stored by the attention kernel (new_v), not by RoPE (an
    # option, off by default: runtime/model.py)
    ex.decoder.decode_writes_v = quant == "fp8"
    width = ex.scheduler.config.max_blocks_per_seq
    ex.graphs = cg.DecodeGraphs(ex.decoder, ex.kv, 8, width, 256, torch.device("cpu"))
    ex.prefill_graphs = cg.PrefillGraphs(
        ex.decoder, ex.kv, [16, 32, 64], width, torch.device("cpu")
    )
    used = {"decode": 0, "prefill": 0}
    for name, runner in (("decode", ex.graphs), ("prefill", ex.prefill_graphs)):

        def counted(plan, *ids, _run=runner.run, _name=name):
            used[_name] += 1
            return _run(plan, *ids)

        runner.run = counted
    batched = [r.output_ids for r in ex.generate(prompts, params)]
    alone = [ex.generate([p], params)[0].output_ids for p in prompts[:3]]
    assert batched == ref, (batched, ref)
    assert alone == ref[:3], (alone, ref[:3])
    assert used["decode"] > 0 and used["prefill"] >= 3, used
    assert ex.decoder.fp8_fused == ex.decoder.fp8_kv == (quant == "fp8")
    assert ex.decoder.fused_rope_kv  # RoPE + KV write in one kernel, FP8 cache included
    assert (ex.decoder.fp8_swiglu_down is not None) == (quant == "fp8")
    check_swiglu_gemv()
    print("ok", family, quant, used)


if __name__ == "__main__":
    main(*sys.argv[1:])
