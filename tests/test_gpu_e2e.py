"""GPU engines end to end (run on the H200 with `pytest -m gpu`): the same tokens as the CPU
reference engine and as transformers on the GPU, in float32, for the four families."""

from __future__ import annotations

import json

import pytest
import torch
from reference_runs import hf_greedy, random_prompts, serve_staggered

from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.examples import make_tiny_hf_model
from ingot.runtime.engine import load_engine
from ingot.runtime.executor import Executor
from ingot.runtime.types import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
BUILD = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}
NEW = 12


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_engine_matches_cpu_engine_and_transformers(tmp_path, family):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = make_tiny_hf_model(family, tmp_path / "hf", seed=1)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="float32")
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=BUILD)
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=BUILD, tactics="default")
    assert json.loads((gpu / "config.json").read_text())["target"].startswith("sm_")
    prompts = random_prompts(load_engine(cpu).config.model.vocab_size, seed=5)
    on_gpu = serve_staggered(gpu, prompts, NEW)
    assert on_gpu == serve_staggered(cpu, prompts, NEW)
    assert on_gpu == hf_greedy(hf, prompts, torch.float32, NEW, device="cuda")


def test_gpu_engine_without_graphs_and_with_preemption_agrees(tmp_path):
    hf = make_tiny_hf_model("qwen2", tmp_path / "hf", seed=3)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="float32")
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=BUILD, tactics="default")
    prompts = random_prompts(load_engine(gpu).config.model.vocab_size, seed=5)
    graphs = serve_staggered(gpu, prompts, NEW)
    assert serve_staggered(gpu, prompts, NEW, cuda_graphs=False) == graphs
    # 10 blocks of 16 tokens cannot hold six sequences: max_utilization preempts and recomputes
    assert serve_staggered(gpu, prompts, NEW, num_kv_blocks=10, policy="max_utilization") == graphs


def test_timed_build_records_tactics_and_matches_cpu(tmp_path):
    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=2)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="float32")
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=BUILD)
    cfg = json.loads((gpu / "config.json").read_text())
    timed = [p for p in cfg["plugins"] if p["timings_ms"]]
    assert any(p["name"] == "paged_attention" for p in timed)
    assert {p["site"] for p in timed if p["name"] == "gemm"} >= {"attn.qkv", "mlp.down", "lm_head"}
    for p in timed:
        fastest = min(p["timings_ms"], key=p["timings_ms"].get)
        # attention combines two winners; a fused down projection's tactic says whether its
        # GEMV beat the activation kernel and the plain GEMM (timed as `unfused`)
        assert p["tactic"] == fastest or "+" in p["tactic"] or "unfused" in p["timings_ms"]
    # the GPU that timed them, so another GPU model of the same SM gets a warning at load
    assert cfg["extra"]["tactics_timed_on"] == torch.cuda.get_device_name()
    # whatever tactics won, a float32 engine still gives the CPU reference's tokens
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=BUILD)
    prompts = random_prompts(load_engine(cpu).config.model.vocab_size, seed=5)
    assert serve_staggered(gpu, prompts, NEW) == serve_staggered(cpu, prompts, NEW)


_COUNT_COMPILES = """
import json, sys
from ingot.plugins.aot import CompileCounter
from ingot.runtime.engine import load_engine
from ingot.runtime.executor import Executor
from ingot.runtime.types import SamplingParams

with CompileCounter() as c:
    ex = Executor(load_engine(sys.argv[1]))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ex.generate([[5, 6, 7], [4] * 17, [3] * 16, [9] * 33], params)
print(json.dumps({"compiled": c.kernels, "names": sorted(c.compiled), "hits": c.cache_hits,
                  "host_builds": c.host_builds, "host_names": c.host_built,
                  "installed": ex.kernels}))
"""


def test_pdl_engines_give_the_same_tokens(tmp_path):
    """Programmatic dependent launch changes when kernels start, never what they compute: a
    bf16 engine (GEMV decode path) gives exactly the tokens of the same engine without it, with
    graphs and (comparing eager with eager) without; a float32 one the CPU reference's.

    NOTE: eager and graph decoding may differ in bf16 (graphs pad the batch to a bucket, which
    can pick another GEMM path), so eager is compared with eager."""
    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=7)
    for dtype in ("bfloat16", "float32"):
        ckpt = convert_checkpoint(hf, tmp_path / f"ckpt-{dtype}", dtype=dtype)
        plain = build_engine(
            ckpt, tmp_path / f"plain-{dtype}", target="auto", overrides=BUILD, tactics="default"
        )
        pdl = build_engine(
            ckpt,
            tmp_path / f"pdl-{dtype}",
            target="auto",
            overrides=BUILD | {"pdl": True},
            tactics="default",
        )
        assert load_engine(pdl).config.build.pdl
        prompts = random_prompts(load_engine(pdl).config.model.vocab_size, seed=5)
        with_pdl = serve_staggered(pdl, prompts, NEW)
        assert with_pdl == serve_staggered(plain, prompts, NEW), dtype
        assert serve_staggered(pdl, prompts, NEW, cuda_graphs=False) == serve_staggered(
            plain, prompts, NEW, cuda_graphs=False
        ), dtype
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=BUILD)
    assert with_pdl == serve_staggered(cpu, prompts, NEW)


def test_fused_norm_engines_give_the_same_tokens(tmp_path):
    """Norms folded into the decode GEMVs (`--fused-norms`, plugins/gemm/fused_norm.py): a
    bf16 engine's greedy tokens are the plain engine's on >= 95% of steps (rstd may differ in
    its last bits), with PDL too; a float32 one (the GEMVs' fallback math) the CPU
    reference's exactly."""
    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=7)
    for dtype in ("bfloat16", "float32"):
        ckpt = convert_checkpoint(hf, tmp_path / f"ckpt-{dtype}", dtype=dtype)
        runs = {}
        for name, extra in (("plain", {}), ("fused", {"fused_norms": True}),
                            ("fused_pdl", {"fused_norms": True, "pdl": True})):  # fmt: skip
            eng = build_engine(ckpt, tmp_path / f"{name}-{dtype}", target="auto",
                               overrides=BUILD | extra, tactics="default")  # fmt: skip
            assert load_engine(eng).config.build.fused_norms == bool(extra)
            prompts = random_prompts(load_engine(eng).config.model.vocab_size, seed=5)
            runs[name] = serve_staggered(eng, prompts, NEW)
        for name in ("fused", "fused_pdl"):
            pairs = [(a, b) for x, y in zip(runs[name], runs["plain"], strict=True)
                     for a, b in zip(x, y, strict=True)]  # fmt: skip
            assert sum(a == b for a, b in pairs) >= 0.95 * len(pairs), (dtype, name)
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=BUILD)
    assert runs["fused"] == serve_staggered(cpu, prompts, NEW)


@pytest.mark.parametrize("tactics", ["auto", "default", "pdl", "fused_norms"])
def test_engine_kernels_load_without_compiling(tmp_path, tactics):
    import os
    import subprocess
    import sys

    from ingot.plugins.norm.triton_kernels import make_rms_norm

    # a Triton kernel launched first (as in any process that ran one before building) has made
    # Triton build its driver utilities in the default cache, not in the build's own
    x = torch.randn(2, 64, device="cuda")
    make_rms_norm(None)(x, torch.ones(64, device="cuda"), 1e-5)
    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=6)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16")
    # "pdl": default tactics, programmatic dependent launch (the kernels' PDL variants)
    pdl = {"pdl": True} if tactics == "pdl" else {}
    if tactics == "fused_norms":  # the folded GEMV variants (PDL ones too)
        pdl = {"pdl": True, "fused_norms": True}
    gpu = build_engine(
        ckpt,
        tmp_path / "gpu",
        target="auto",
        overrides=BUILD | pdl,
        tactics="default" if pdl else tactics,
    )
    assert (gpu / "kernels.bin").is_file()
    # a fresh process with empty Triton and ingot caches: only the engine's kernels exist
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        TRITON_CACHE_DIR=str(tmp_path / "empty-triton"),
    )
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_COMPILES, str(gpu)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["installed"] > 0 and counts["hits"] > 0
    assert counts["compiled"] == 0, counts["names"]
    if tactics == "auto":  # built on this GPU: Triton's launcher modules ship too
        assert counts["host_builds"] == 0, counts["host_names"]


def test_engine_from_another_triton_is_refused(tmp_path, monkeypatch):
    import triton

    from ingot.runtime.errors import EngineError

    hf = make_tiny_hf_model("qwen3", tmp_path / "hf", seed=6)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16")
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=BUILD, tactics="default")
    monkeypatch.setattr(triton, "__version__", "0.0.1")
    with pytest.raises(EngineError, match="Triton") as e:
        Executor(load_engine(gpu))
    assert "rebuild" in e.value.one_line()


def test_long_lone_prompts_run_in_large_prefill_graphs_or_eagerly(tmp_path):
    """A lone prompt above 512 tokens runs in a large prefill graph when it pads the bucket by
    little (runtime/cuda_graphs.py), eagerly otherwise; the tokens are the CPU engine's."""
    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=4, max_position_embeddings=2048)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="float32")
    build = BUILD | {"max_seq_len": 1280, "max_num_tokens": 1024}
    gpu = build_engine(ckpt, tmp_path / "gpu", target="auto", overrides=build, tactics="default")
    cpu = build_engine(ckpt, tmp_path / "cpu", target="cpu", overrides=build)
    vocab = load_engine(cpu).config.model.vocab_size
    g = torch.Generator().manual_seed(9)
    lens = [1024, 730, 600, 768]  # 1024 and 768 exactly; 730 padded by 38; 600 eagerly
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    ex = Executor(load_engine(gpu))
    assert ex.prefill_graphs.buckets[-2:] == [768, 1024]
    used = []
    run = ex.prefill_graphs.run
    ex.prefill_graphs.run = lambda plan, *a: used.append(plan.num_tokens) or run(plan, *a)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    on_gpu = [ex.generate([p], params)[0].output_ids for p in prompts]
    assert used == [1024, 730, 768]
    ref = Executor(load_engine(cpu))
    assert on_gpu == [ref.generate([p], params)[0].output_ids for p in prompts]
