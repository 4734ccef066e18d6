"""Quantized engines end to end on the GPU (H200 run, `pytest -m gpu`): FP8 (with FP8 KV cache)
and INT4 AWQ engines give the CPU reference engine's greedy tokens on >= 95% of steps.

One checkpoint per mode (calibrated on the CPU), built twice: for the CPU and for this GPU.
NOTE: the tiny model is first trained to map each token to a fixed other one
(`train_next_token_map`). With random weights the top-1 margins are a few tenths of a nat, and
FP8 activation quantization turns the GPU's other summation order into whole fp8 steps: on
the CPU, 1e-5 relative noise in the FP8 GEMM outputs already dropped the strict agreement of a
random model to 55% (1e-4: 35%, what the H200 measured). The trained model keeps 100% under
2e-2 (tests/test_quant.py checks that on the CPU), so this test is about the kernels.
"""

from __future__ import annotations

import pytest
import torch
from reference_runs import random_prompts, serve_staggered, strict_agreement, train_next_token_map

from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.quantize import QuantOptions
from ingot.runtime.engine import load_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("modelopt.torch.quantization")

SIZES = {"hidden_size": 128, "intermediate_size": 256}  # K a multiple of group size 128
BUILD = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}
NEW = 16
# (weight mode, KV-cache dtype). FP8 weights and the FP8 KV cache also run apart, so a failure
# says which half it is in (the 13:00 round: fp8+fp8 failed at 35-40%, int4 passed).
MODES = {
    "fp8": ("fp8", "fp8"),
    "fp8_weights": ("fp8", "auto"),
    "fp8_kv": ("none", "fp8"),
    "int4_awq": ("int4_awq", "auto"),
    # --quant-lm-head: the lm_head's FP8 GEMM on the GPU too
    "fp8_lm_head": ("fp8", "fp8"),
    "int4_awq_lm_head": ("int4_awq", "auto"),
    # build-engine --fp8-fast-accum: cuBLASLt's FP8 GEMMs (prefill rows) without fp32 promotion
    "fp8_fast_accum": ("fp8", "fp8"),
}


CASES = [(m, f) for m in MODES for f in ("llama", "qwen2")]
CASES = [c for c in CASES if c[0] in ("fp8", "int4_awq") or c[1] == "llama"]


@pytest.mark.parametrize("mode,family", CASES)
def test_quantized_gpu_engine_agrees_with_cpu_engine(tmp_path, family, mode):
    from ingot.compiler.examples import make_tiny_hf_model

    weights, kv = MODES[mode]
    fp8 = "fp8" in (weights, kv) or mode.endswith("_lm_head")
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs SM >= 89")
    hf = train_next_token_map(make_tiny_hf_model(family, tmp_path / "hf", seed=4, **SIZES))
    opts = QuantOptions(
        weights,
        kv,
        calib_size=8,
        calib_max_seq_len=64,
        device="cpu",
        lm_head=mode.endswith("_lm_head"),
    )
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16", quant=opts)
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=BUILD)
    # FP8 tactics timed here; INT4's timed choice (12 tactics x 4 sites) is the slow part of a
    # build, so the test takes the default table for it
    tactics = "default" if weights == "int4_awq" else "auto"
    fast = mode == "fp8_fast_accum"
    build = dict(BUILD, fp8_fast_accum=True) if fast else BUILD
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=build, tactics=tactics)
    gpu_cfg = load_engine(gpu).config
    quant = gpu_cfg.quant
    fp8_gemms = [c for c in gpu_cfg.plugins if c.name.startswith("fp8_")]
    assert fp8_gemms or weights != "fp8"
    for c in fp8_gemms:
        _check_cublaslt(c, fast, gpu_cfg.build, timed=tactics == "auto")
    assert (quant.mode, quant.kv_cache_dtype, quant.lm_head) == (weights, kv, opts.lm_head)
    prompts = random_prompts(load_engine(cpu).config.model.vocab_size, seed=9)
    on_cpu = serve_staggered(cpu, prompts, NEW)
    on_gpu = serve_staggered(gpu, prompts, NEW)
    assert strict_agreement(on_gpu, on_cpu) >= 0.95, (on_gpu, on_cpu)
    # without graphs (eager decode) the GPU engine makes the same choices as with them
    assert strict_agreement(serve_staggered(gpu, prompts, NEW, cuda_graphs=False), on_gpu) >= 0.95


def _fp8_engines(tmp_path):
    """A tiny Llama's FP8 (W8A8, FP8 KV) checkpoint built as a CPU and a GPU engine."""
    from ingot.compiler.examples import make_tiny_hf_model

    hf = train_next_token_map(make_tiny_hf_model("llama", tmp_path / "hf", seed=4, **SIZES))
    opts = QuantOptions("fp8", "fp8", calib_size=8, calib_max_seq_len=64, device="cpu")
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16", quant=opts)
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=BUILD)
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=BUILD, tactics="default")
    return cpu, gpu


def test_fp8_queries_experiment_engine_agrees_with_cpu_engine(tmp_path, monkeypatch):
    """INGOT_FP8_QUERIES=1 (plugins/attention/triton_decode.py, an A/B switch): a GPU FP8 engine
    whose prompts' Q.K run in FP8 still gives the CPU engine's greedy tokens on >= 95% of steps
    (through graphs and eager steps), and its prefill kernel did run with fp8_queries."""
    from ingot.plugins.attention import triton_decode as dec

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs SM >= 89")
    cpu, gpu = _fp8_engines(tmp_path)
    calls = []
    launch = dec.launch_prefill

    def spy(*args, fp8_queries=False, **kw):
        calls.append(fp8_queries)
        return launch(*args, fp8_queries=fp8_queries, **kw)

    monkeypatch.setattr(dec, "launch_prefill", spy)
    monkeypatch.setenv(dec.FP8_QUERIES_ENV, "1")
    prompts = random_prompts(load_engine(cpu).config.model.vocab_size, seed=9)
    on_gpu = serve_staggered(gpu, prompts, NEW)
    assert any(calls) and all(calls), calls
    monkeypatch.delenv(dec.FP8_QUERIES_ENV)
    on_cpu = serve_staggered(cpu, prompts, NEW)
    assert strict_agreement(on_gpu, on_cpu) >= 0.95, (on_gpu, on_cpu)


def test_fp8mma_decode_experiment_engine_agrees_with_cpu_engine(tmp_path, monkeypatch):
    """INGOT_FP8MMA_DECODE=1 (plugins/attention/triton_decode.py, an A/B switch; its row
    threshold lowered so that the tiny model's batches reach it): a GPU FP8 engine whose decode
    attention runs both dots in FP8 still gives the CPU engine's greedy tokens on >= 95% of
    steps, through graphs and eager steps, and the experiment's kernel did run."""
    from ingot.plugins.attention import triton_decode as dec

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 wgmma needs SM >= 90")
    cpu, gpu = _fp8_engines(tmp_path)
    calls = []
    kernel = dec.decode_fp8mma

    def spy(q, *args, **kw):
        calls.append(q.shape[0])
        return kernel(q, *args, **kw)

    monkeypatch.setattr(dec, "decode_fp8mma", spy)
    monkeypatch.setattr(dec, "LARGE_BATCH_ROWS", 2)
    monkeypatch.setenv(dec.FP8MMA_ENV, "1")
    prompts = random_prompts(load_engine(cpu).config.model.vocab_size, seed=9)
    on_gpu = serve_staggered(gpu, prompts, NEW)
    assert calls, "the FP8-MMA decode never ran"
    monkeypatch.delenv(dec.FP8MMA_ENV)
    on_cpu = serve_staggered(cpu, prompts, NEW)
    assert strict_agreement(on_gpu, on_cpu) >= 0.95, (on_gpu, on_cpu)


def _check_cublaslt(choice, fast: bool, build, timed: bool) -> None:
    """Fast accumulation off unless asked for; a GEMM of a known shape in a timed build was
    timed in both modes at each of the engine's row counts, runs fast accumulation (if asked
    for) where it won, and pads the rows whose padded size ran faster."""
    from ingot.compiler.fast_accum import fast_rows_from, pad_rows_of, site_of, timed_rows

    params, timings = choice.params or {}, choice.timings_ms or {}
    site = site_of(choice)
    if not timed or site is None:
        assert bool(params.get("fast_accum")) == fast and "pad_rows" not in params, choice
        return
    rows = timed_rows(build, site)  # none for an lm_head under 16 sequences: nothing timed
    times = {r: (timings[f"promoted@rows{r}"], timings[f"fast_accum@rows{r}"]) for r in rows}
    where = fast_rows_from(times) if fast else None
    assert params.get("fast_accum_rows") == where, choice
    assert bool(params.get("fast_accum")) == (where is not None), choice
    assert params.get("pad_rows") == pad_rows_of(times, where), choice


def _with_pdl(engine_dir):
    """The engine loaded as if built with --pdl (its PDL kernel variants compile on first use)."""
    import dataclasses

    eng = load_engine(engine_dir)
    build = dataclasses.replace(eng.config.build, pdl=True)
    return dataclasses.replace(eng, config=dataclasses.replace(eng.config, build=build))


@pytest.mark.parametrize("mode", ["fp8", "fp8_kv", "fp8_weights"])
def test_pdl_variants_of_fp8_engines_give_the_same_tokens(tmp_path, mode):
    """FP8 engines with PDL faulted and disagreed with the CPU engine on the H200 (12-04; the
    cause: plugins/gemm/cuda.py's unrolled GEMV loop with its bounds out of order). PDL
    changes when kernels start, never what they compute: the same engine (default tactics)
    with its PDL variants, both trigger points, three times each, gives exactly its tokens
    without them."""
    from reference_runs import serve_engine_staggered

    from ingot.compiler.examples import make_tiny_hf_model
    from ingot.plugins import pdl

    weights, kv = MODES[mode]
    hf = train_next_token_map(make_tiny_hf_model("llama", tmp_path / "hf", seed=4, **SIZES))
    opts = QuantOptions(weights, kv, calib_size=8, calib_max_seq_len=64, device="cpu")
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16", quant=opts)
    plain_build = BUILD | {"pdl": False}
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=plain_build,
                       tactics="default")  # fmt: skip
    assert not load_engine(gpu).config.build.pdl
    prompts = random_prompts(load_engine(gpu).config.model.vocab_size, seed=9)
    plain = serve_staggered(gpu, prompts, NEW)
    prev = pdl.TRIGGER
    try:
        for trigger in ("after_wait", "before_wait"):
            pdl.TRIGGER = trigger
            for _ in range(3):
                assert serve_engine_staggered(_with_pdl(gpu), prompts, NEW) == plain, trigger
    finally:
        pdl.TRIGGER = prev
