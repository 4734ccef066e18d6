"""Tensor parallelism on the CPU (gloo): sharding, tp 2 == tp 1 token for token, failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_checks import assert_one_line_error, invoke

from ingot.compiler.build import build_engine
from ingot.compiler.checkpoint import load_checkpoint
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.examples import make_tiny_hf_model
from ingot.compiler.shard import shard_tensor
from ingot.runtime.config import ModelConfig
from ingot.runtime.distributed import TPTimeouts
from ingot.runtime.engine import load_engine
from ingot.runtime.errors import ConfigError, EngineError
from ingot.runtime.executor import Executor
from ingot.runtime.llm import LLM
from ingot.runtime.types import FinishReason, SamplingParams

VARIANTS = {
    "llama": {},
    "llama-tied-odd-vocab": {"tie_word_embeddings": True, "vocab_size": 511},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
}
PROMPT_LENS = [3, 9, 17, 30, 41, 64]
NEW_TOKENS = 10
BUILD = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 8}
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """variant -> (hf dir, {tp: checkpoint dir}, {tp: engine dir}), made once per module."""
    cache: dict[str, tuple[Path, dict[int, Path], dict[int, Path]]] = {}

    def get(variant: str):
        if variant not in cache:
            root = tmp_path_factory.mktemp(f"tp-{variant}")
            family = variant.split("-")[0]
            hf = make_tiny_hf_model(
                family, root / "hf", dtype="float32", seed=1, **VARIANTS[variant]
            )
            ckpts, engines = {}, {}
            for tp in (1, 2):
                ckpts[tp] = convert_checkpoint(hf, root / f"ckpt{tp}", dtype="float32", tp_size=tp)
                engines[tp] = build_engine(
                    ckpts[tp], root / f"engine{tp}", target="cpu", overrides=BUILD
                )
            cache[variant] = (hf, ckpts, engines)
        return cache[variant]

    return get


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _serve_staggered(ex: Executor, prompts, n: int) -> list[list[int]]:
    """As tests/test_e2e_cpu.py: five prompts together, the sixth joins while they decode."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    reqs = [ex.add_request(p, params) for p in prompts[:-1]]
    for _ in range(3):
        ex.step()
    assert any(r.output_ids for r in reqs)
    reqs.append(ex.add_request(prompts[-1], params))
    ex.run_until_done()
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    ex.scheduler.check_integrity()
    return [r.output_ids for r in reqs]


# --- sharding --------------------------------------------------------------------------------


def _unshard(cfg: ModelConfig, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of compiler/shard.py for one tensor."""
    tp = len(parts)
    if ".attn.qkv." in name:
        qs, ks, vs = zip(
            *(p.split([cfg.q_size // tp, cfg.kv_size // tp, cfg.kv_size // tp]) for p in parts),
            strict=True,
        )
        return torch.cat([*qs, *ks, *vs])
    if ".mlp.gate_up." in name:
        gates, ups = zip(*(p.chunk(2) for p in parts), strict=True)
        return torch.cat([*gates, *ups])
    if ".attn.o." in name or ".mlp.down." in name:
        return torch.cat(parts, dim=1)
    if name in ("embed.weight", "lm_head.weight"):
        return torch.cat(parts)[: cfg.vocab_size]
    assert all(torch.equal(p, parts[0]) for p in parts), name  # replicated
    return parts[0]


@pytest.mark.parametrize("variant", ["llama-tied-odd-vocab", "qwen2", "qwen3"])
def test_shards_reassemble_to_the_tp1_checkpoint(built, variant):
    _, ckpts, _ = built(variant)
    meta1, full = load_checkpoint(ckpts[1])
    cfg = meta1["model"]
    ranks = [load_checkpoint(ckpts[2], rank=r) for r in range(2)]
    meta2 = ranks[0][0]
    assert meta2["tp_size"] == 2 and set(meta2["rank_files"]) == {
        "rank0.safetensors",
        "rank1.safetensors",
    }
    assert set(ranks[0][1]) == set(full)
    for name in full:
        parts = [t[name] for _, t in ranks]
        assert torch.equal(_unshard(cfg, name, parts), full[name]), name
    if cfg.vocab_size % 2:  # padded vocabulary: recorded, padding rows zero
        assert meta2["padded_vocab_size"] == cfg.vocab_size + 1
        assert not ranks[1][1]["embed.weight"][-1].any()


def test_qkv_shard_keeps_gqa_groups_within_a_rank():
    cfg = ModelConfig("X", "llama", 10, 8, 8, 1, num_heads=4, num_kv_heads=2, head_dim=1,
                      max_position_embeddings=8)  # fmt: skip
    qkv = torch.arange(8.0)  # q heads 0..3, k heads 4..5, v heads 6..7
    assert shard_tensor(cfg, "layers.0.attn.qkv.bias", qkv, 2, 1).tolist() == [2, 3, 5, 7]
    emb = torch.ones(10, 8)
    assert shard_tensor(cfg, "embed.weight", emb, 4, 3).shape == (3, 8)  # 10 -> 12 rows
    assert not shard_tensor(cfg, "embed.weight", emb, 4, 3)[1:].any()


@pytest.mark.parametrize("tp", ["3", "0", "8"])
def test_bad_tp_size_is_refused_in_one_line(tiny_hf_dir, tmp_path, tp):
    hf = tiny_hf_dir("llama")
    r = invoke("convert-checkpoint", "--model-dir", hf, "--output-dir", tmp_path / "c",
               "--tp-size", tp)  # fmt: skip
    assert_one_line_error(r, "--tp-size")
    if tp != "0":
        assert "num_heads 4" in r.stderr and "num_kv_heads 2" in r.stderr
    assert not (tmp_path / "c").exists()


def test_quantized_tp_is_refused_in_one_line(tiny_hf_dir, tmp_path):
    r = invoke("convert-checkpoint", "--model-dir", tiny_hf_dir("llama"), "--output-dir",
               tmp_path / "c", "--quant", "fp8", "--tp-size", "2")  # fmt: skip
    assert_one_line_error(r)
    assert "tp" in r.stderr


def test_engine_lists_every_rank_and_a_plain_executor_is_refused(built):
    _, _, engines = built("qwen2")
    cfg = json.loads((engines[2] / "config.json").read_text())
    assert cfg["tp_size"] == 2 and {"rank0.engine", "rank1.engine"} <= set(cfg["rank_files"])
    r = invoke("inspect-engine", engines[2])
    assert r.exit_code == 0 and "tp_size 2" in r.output and "rank1.engine" in r.output
    with pytest.raises(ConfigError, match="tp_size 2"):
        Executor(load_engine(engines[2]))


# --- serving ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_matches_tp1(built, variant):
    _, _, engines = built(variant)
    vocab = load_engine(engines[1]).config.model.vocab_size
    prompts = _prompts(min(vocab, 500), seed=5)
    ref = _serve_staggered(Executor(load_engine(engines[1])), prompts, NEW_TOKENS)
    # NOTE: the same API the CLI uses: ranks 1.. are spawned processes, this one is rank 0.
    with LLM(engines[2]) as llm:
        ours = _serve_staggered(llm.executor, prompts, NEW_TOKENS)
        # Prompt logits (a collective every rank mirrors) match tp 1 closely.
        params = SamplingParams(max_new_tokens=2, ignore_eos=True, return_prompt_logits=True)
        fresh = _prompts(min(vocab, 500), seed=9)[2]  # not served before: no prefix reuse
        req = llm.executor.add_request(fresh, params)
        llm.executor.run_until_done()
    assert ours == ref
    ex1 = Executor(load_engine(engines[1]))
    req1 = ex1.add_request(fresh, params)
    ex1.run_until_done()
    torch.testing.assert_close(torch.cat(req.prompt_logits), torch.cat(req1.prompt_logits))
    assert req.output_ids == req1.output_ids


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ingot.cli", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **(env or {})},
    )


def _run_args(engine: Path) -> list[str]:
    args = ["run-engine", "--engine-dir", str(engine), "--max-output-len", "8"]
    for p in PROMPTS:
        args += ["--input-text", p]
    return args


def test_cli_run_engine_tp2_prints_the_tp1_text(built):
    _, _, engines = built("llama")
    one = invoke(*_run_args(engines[1]))
    assert one.exit_code == 0, one.output
    two = _cli(*_run_args(engines[2]))
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and "Output:" in two.stdout


def test_a_failing_rank_stops_the_group_in_one_line(built):
    _, _, engines = built("llama")
    t0 = time.monotonic()
    r = _cli(*_run_args(engines[2]), env={"INGOT_TEST_FAIL_RANK": "1:2"})
    took = time.monotonic() - t0
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "rank 1 of 2 failed" in err[0] and "injected test failure at step 2" in err[0]
    assert took < 60  # no hang: subprocess.run returned, so no rank kept the pipes open


def test_a_rank_that_cannot_load_is_named(built, tmp_path):
    import shutil

    _, _, engines = built("mistral")
    bad = tmp_path / "engine"
    shutil.copytree(engines[2], bad)
    with open(bad / "rank1.engine", "r+b") as f:  # corrupt rank 1's file only
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    with pytest.raises(Exception, match="rank 1 of 2 failed.*checksum"):
        LLM(bad)


def test_a_hung_rank_times_out_and_the_group_stops(built, monkeypatch):
    _, _, engines = built("qwen3")
    monkeypatch.setenv("INGOT_TEST_FAIL_RANK", "1:2:hang")
    t0 = time.monotonic()
    llm = LLM(engines[2], tp_timeouts=TPTimeouts(init_s=60, collective_s=2))
    procs = list(llm.group.procs.values())
    with pytest.raises(EngineError, match="did not complete within 2 s"):
        llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert time.monotonic() - t0 < 30
    assert not any(p.is_alive() for p in procs)
    llm.close()
