"""build-engine / inspect-engine / run-engine through the CLI, good input and bad."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest
from cli_checks import assert_one_line_error, invoke

from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.examples import make_tiny_hf_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    hf = make_tiny_hf_model("llama", root / "hf", seed=2)
    return convert_checkpoint(hf, root / "ckpt", dtype="float32")


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engines") / "engine"
    r = invoke(
        "build-engine",
        "--checkpoint-dir",
        ckpt,
        "--output-dir",
        out,
        "--config",
        "tiny-llama",
        "--target",
        "cpu",
        "--max-seq-len",
        "64",
    )
    assert r.exit_code == 0, r.output
    return out


def _copy(engine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(engine, dst)
    return dst


def _edit_config(engine: Path, **changes) -> None:
    path = engine / "config.json"
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if k == "target":
            d["target"] = d["build"]["target"] = v
        else:
            d[k] = v
    path.write_text(json.dumps(d))


def test_build_records_everything_and_inspect_verifies(engine):
    d = json.loads((engine / "config.json").read_text())
    assert d["format"] == "ingot-engine" and d["format_version"] == 1 and d["ingot_version"]
    assert d["target"] == "cpu" and d["build"]["max_seq_len"] == 64  # flag beat the preset (256)
    assert d["build"]["max_batch_size"] == 8  # from the preset
    assert {p["name"] for p in d["plugins"]} >= {"paged_attention", "rms_norm", "rope", "gemm"}
    assert set(d["rank_files"]) == {"rank0.engine"} and len(d["rank_files"]["rank0.engine"]) == 64
    assert len(d["rank_chunks"]["files"]["rank0.engine"]) >= 1  # chunk digests for fast loads
    assert (engine / "tokenizer" / "tokenizer_config.json").is_file()
    phases = d["extra"]["build_seconds"]  # where a build's time went, phase by phase
    assert list(phases) == [
        "checkpoint", "weights", "tactics", "kernels", "rank_files_wait", "tokenizer",
        "checkpoint_verify_wait",  # its sha256, checked beside the phases before
    ]  # fmt: skip
    assert all(v >= 0 for v in phases.values())
    r = invoke("inspect-engine", engine)
    assert r.exit_code == 0, r.output
    assert "build time" in r.stdout and "tactics" in r.stdout
    assert (
        "verified" in r.stdout and "LlamaForCausalLM" in r.stdout and "paged_attention" in r.stdout
    )


def test_run_engine_prints_outputs_and_streams(engine):
    r = invoke(
        "run-engine",
        "--engine-dir",
        engine,
        "--input-text",
        "Hello there",
        "--input-text",
        "The engine",
        "--max-output-len",
        "5",
    )
    assert r.exit_code == 0, r.output
    assert "[0] Output:" in r.stdout and "[1] Output:" in r.stdout
    # unpipelined: the same text (greedy)
    plain = invoke("run-engine", "--engine-dir", engine, "--input-text", "Hello there",
                   "--input-text", "The engine", "--max-output-len", "5", "--no-pipeline")  # fmt: skip
    assert plain.exit_code == 0, plain.output
    assert plain.stdout == r.stdout
    r = invoke(
        "run-engine",
        "--engine-dir",
        engine,
        "--input-text",
        "Hi",
        "--max-output-len",
        "4",
        "--streaming",
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--seed",
        "3",
    )
    assert r.exit_code == 0, r.output


def test_altered_rank_file_is_refused(engine, tmp_path):
    e = _copy(engine, tmp_path)
    with open(e / "rank0.engine", "r+b") as f:
        f.seek(-10, 2)
        b = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert_one_line_error(invoke("inspect-engine", e), "checksum")
    assert_one_line_error(
        invoke("run-engine", "--engine-dir", e, "--input-text", "x", "--max-output-len", "2"),
        "checksum",
    )


def test_future_format_version_is_refused(engine, tmp_path):
    e = _copy(engine, tmp_path)
    _edit_config(e, format_version=99)
    assert_one_line_error(
        invoke("run-engine", "--engine-dir", e, "--input-text", "x", "--max-output-len", "2"),
        "version 99",
        "upgrade",
    )


# the flag given (None: neither flag; the preset sets none) -> PDL in the engine: on by
# default for an sm_90 target
@pytest.mark.parametrize("flag,pdl", [(None, True), ("--no-pdl", False), ("--pdl", True)])
def test_cross_build_for_gpu_uses_default_tactics(ckpt, tmp_path, flag, pdl):
    pytest.importorskip("triton", reason="cross-building GPU engines needs triton installed")
    e = tmp_path / "gpu-engine"
    r = invoke(
        "build-engine",
        "--checkpoint-dir",
        ckpt,
        "--output-dir",
        e,
        "--target",
        "sm_90",
        "--config",
        "tiny-llama",
        *([flag] if flag else []),
    )
    assert r.exit_code == 0, r.output
    d = json.loads((e / "config.json").read_text())
    assert d["target"] == "sm_90"
    assert d["build"]["pdl"] is pdl
    r = invoke("inspect-engine", "--engine-dir", e)  # the option form run-engine also takes
    assert r.exit_code == 0 and ("programmatic dependent launch" in r.output) is pdl
    assert_one_line_error(invoke("inspect-engine"), "one engine dir")
    by_site = {(p["name"], p["site"]): p for p in d["plugins"]}
    assert all(p["tactic"] and p["params"] is not None for p in d["plugins"])
    assert ("gemm", "attn.qkv") in by_site and ("gemm", "lm_head") in by_site
    assert all(p["timings_ms"] is None for p in d["plugins"])  # nothing was timed: no GPU here
    assert "tactics_timed_on" not in d["extra"] and "default table" in r.output
    # built for a GPU, so refused on the CPU with a hint
    assert_one_line_error(
        invoke("run-engine", "--engine-dir", e, "--input-text", "x", "--max-output-len", "2"),
        "sm_90",
        "--target cpu",
    )


def test_pdl_on_a_cpu_build_is_one_line(ckpt, tmp_path):
    r = invoke(
        "build-engine", "--checkpoint-dir", ckpt, "--output-dir", tmp_path / "e",
        "--target", "cpu", "--config", "tiny-llama", "--pdl",
    )  # fmt: skip
    assert_one_line_error(r, "pdl needs an sm_90")
    assert not (tmp_path / "e").exists()


def test_fused_norms_flag_builds_a_gpu_engine_and_refuses_a_cpu_one(ckpt, tmp_path):
    """--fused-norms is recorded in a GPU engine (cross-built: its folded kernels bundled)
    and shown by inspect-engine; on a cpu target it is one line, exit 2, nothing written."""
    pytest.importorskip("triton", reason="cross-building GPU engines needs triton installed")
    e = tmp_path / "gpu-engine"
    r = invoke(
        "build-engine", "--checkpoint-dir", ckpt, "--output-dir", e, "--target", "sm_90",
        "--config", "tiny-llama", "--fused-norms",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads((e / "config.json").read_text())["build"]["fused_norms"] is True
    r = invoke("inspect-engine", "--engine-dir", e)
    assert r.exit_code == 0 and "norms folded into the decode GEMVs" in r.output
    r = invoke(
        "build-engine", "--checkpoint-dir", ckpt, "--output-dir", tmp_path / "c",
        "--target", "cpu", "--config", "tiny-llama", "--fused-norms",
    )  # fmt: skip
    assert_one_line_error(r, "fused_norms", "GPU target")
    assert not (tmp_path / "c").exists()


def test_max_num_tokens_below_max_batch_size_builds_with_a_note(ckpt, tmp_path):
    r = invoke(
        "build-engine", "--checkpoint-dir", ckpt, "--output-dir", tmp_path / "e",
        "--target", "cpu", "--config", "tiny-llama", "--max-batch-size", "8",
        "--max-num-tokens", "4",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    note = r.stderr.strip().splitlines()
    assert len(note) == 1 and note[0].startswith("note: --max-num-tokens 4 is below"), r.stderr
    ok = invoke(
        "build-engine", "--checkpoint-dir", ckpt, "--output-dir", tmp_path / "f",
        "--target", "cpu", "--config", "tiny-llama", "--max-batch-size", "8",
    )  # fmt: skip
    assert ok.exit_code == 0 and "note:" not in ok.stderr, ok.output


def test_gpu_engine_on_cpu_is_refused(engine, tmp_path):
    e = _copy(engine, tmp_path)
    _edit_config(e, target="sm_90")
    assert_one_line_error(
        invoke("run-engine", "--engine-dir", e, "--input-text", "x", "--max-output-len", "2"),
        "sm_90",
    )


def test_engine_tuned_on_another_gpu_model_runs_with_a_one_line_warning(
    engine, tmp_path, monkeypatch
):
    from ingot.runtime import engine as engine_mod

    e = _copy(engine, tmp_path)
    d = json.loads((e / "config.json").read_text())
    _edit_config(e, extra=d["extra"] | {engine_mod.TACTICS_TIMED_ON: "NVIDIA H200"})
    # NOTE: a CPU run has no GPU name to compare: check_target is given one
    real = engine_mod.check_target
    monkeypatch.setattr(
        engine_mod,
        "check_target",
        lambda cfg, dev: (real(cfg, dev), engine_mod.warn_if_tuned_elsewhere(cfg, "NVIDIA H100")),
    )
    r = invoke("run-engine", "--engine-dir", e, "--input-text", "x", "--max-output-len", "2")
    assert r.exit_code == 0, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: "), r.stderr
    assert "NVIDIA H200" in err[0] and "NVIDIA H100" in err[0] and "--target auto" in err[0]
    assert "Output:" in r.stdout
    r = invoke("inspect-engine", e)
    assert r.exit_code == 0 and "tactics timed on NVIDIA H200" in r.stdout, r.output


def test_inspect_says_when_a_fused_down_projection_runs_unfused(engine, tmp_path):
    """A fused down projection whose timed tactic has no GEMV (the build found the activation
    kernel plus the plain GEMM faster: `unfused` in its timings) is shown as unfused; one
    that kept its GEMV is not."""
    e = _copy(engine, tmp_path)
    d = json.loads((e / "config.json").read_text())
    timings = {"gemv_n8_k1024_w4_s1": 0.0448, "cublas": 0.0450, "unfused": 0.0452}
    fused = {"name": "swiglu_gemm", "version": 1, "site": None, "timings_ms": timings}
    for tactic, params, shown in (("cublas", {}, True),
                                  ("gemv_n8_k1024_w4_s1", {"max_m": 4, "block_n": 8}, False)):  # fmt: skip
        plugins = [p for p in d["plugins"] if p["name"] != "swiglu_gemm"]
        plugins.append(fused | {"tactic": tactic, "params": params})
        _edit_config(e, plugins=plugins)
        r = invoke("inspect-engine", e)
        assert r.exit_code == 0, r.output
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith("swiglu_gemm"))
        assert ("unfused: the activation kernel, then the GEMM at mlp.down" in line) == shown, line


def test_tuned_elsewhere_warns_only_for_another_gpu_model(engine):
    from ingot.runtime.engine import TACTICS_TIMED_ON, read_engine_config, warn_if_tuned_elsewhere
    from ingot.runtime.errors import IngotWarning

    cfg = read_engine_config(engine)
    assert TACTICS_TIMED_ON not in cfg.extra  # a CPU engine: nothing was timed on a GPU
    timed = dataclasses.replace(cfg, extra=cfg.extra | {TACTICS_TIMED_ON: "NVIDIA H200"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        warn_if_tuned_elsewhere(cfg, "NVIDIA H100")
        warn_if_tuned_elsewhere(timed, "NVIDIA H200")
    with pytest.warns(IngotWarning, match="timed on NVIDIA H200, this GPU is NVIDIA H100"):
        warn_if_tuned_elsewhere(timed, "NVIDIA H100")
    r = invoke("inspect-engine", engine)
    assert "tactics from the default table" in r.stdout, r.output


def test_prompt_too_long_fails_that_request_only(engine):
    long_text = " ".join(["compiler"] * 200)
    r = invoke(
        "run-engine",
        "--engine-dir",
        engine,
        "--input-text",
        "short one",
        "--input-text",
        long_text,
        "--max-output-len",
        "3",
    )
    assert r.exit_code == 2
    assert "[0] Output:" in r.stdout and "[1] Output:" not in r.stdout
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: request 1: prompt length") and "64" in err[0]
    assert err[0].count("request") == 1  # the prompt's index, not the executor's id again


def test_existing_output_is_kept_unless_force(ckpt, engine):
    before = (engine / "config.json").read_text()
    r = invoke("build-engine", "--checkpoint-dir", ckpt, "--output-dir", engine, "--target", "cpu")
    assert_one_line_error(r, "already holds an engine", "--force")
    assert (engine / "config.json").read_text() == before
    r = invoke(
        "build-engine",
        "--checkpoint-dir",
        ckpt,
        "--output-dir",
        engine,
        "--target",
        "cpu",
        "--config",
        "tiny-llama",
        "--max-seq-len",
        "64",
        "--force",
    )
    assert r.exit_code == 0, r.output


def test_interrupted_build_leaves_nothing(ckpt, tmp_path):
    out = tmp_path / "engine"

    def interrupt(step: str, done: int, total: int) -> None:
        if done == total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_engine(ckpt, out, target="cpu", progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_output_over_the_checkpoint_is_refused_even_with_force(ckpt, tmp_path):
    """--output-dir at the checkpoint dir, or at a dir above it, would delete the checkpoint when
    the engine replaces it: one line, exit 2, the checkpoint untouched."""
    work = tmp_path / "work"
    shutil.copytree(ckpt, work / "ckpt")
    before = sorted(p.name for p in (work / "ckpt").iterdir())
    for out in (work / "ckpt", work, tmp_path):
        r = invoke("build-engine", "--checkpoint-dir", work / "ckpt", "--output-dir", out,
                   "--target", "cpu", "--force")  # fmt: skip
        assert_one_line_error(r, f"--output-dir {out} would replace the checkpoint dir")
        assert sorted(p.name for p in (work / "ckpt").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_output_dir_that_cannot_be_made_is_one_line(ckpt, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "engine"
    r = invoke("build-engine", "--checkpoint-dir", ckpt, "--output-dir", out, "--target", "cpu")
    assert_one_line_error(r, f"cannot create {out}", "writable --output-dir")


def test_a_bug_in_a_build_is_one_line_and_a_crash_report(ckpt, tmp_path, monkeypatch):
    """Not bad input (exit 2) but a bug: one line, exit 1, the traceback in a report file, no
    engine left behind; INGOT_TRACEBACK=1 lets the exception through for debugging."""
    import tempfile

    import ingot.compiler.build as build_mod

    def boom(*a, **k):
        raise SystemError("AST constructor recursion depth mismatch (before=198, after=295)")

    monkeypatch.setattr(build_mod, "_write_file", boom)
    reports = tmp_path / "tmp"
    reports.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(reports))
    out = tmp_path / "out" / "engine"
    args = ("build-engine", "--checkpoint-dir", ckpt, "--output-dir", out, "--target", "cpu")
    monkeypatch.delenv("INGOT_TRACEBACK", raising=False)
    r = invoke(*args)
    assert r.exit_code == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: internal error") and "Traceback" not in r.output
    assert "SystemError: AST constructor recursion depth mismatch" in line
    (report,) = reports.glob("ingot-crash-*.txt")
    assert str(report) in line
    text = report.read_text()
    assert "Traceback" in text and "in boom" in text and "ingot " in text.splitlines()[0]
    assert list((tmp_path / "out").iterdir()) == []

    monkeypatch.setenv("INGOT_TRACEBACK", "1")
    r = invoke(*args)
    assert isinstance(r.exception, SystemError) and r.exit_code == 1
    assert len(list(reports.glob("ingot-crash-*.txt"))) == 1
    assert list((tmp_path / "out").iterdir()) == []


def test_outputs_cut_by_max_seq_len_get_a_note(engine):
    """Asking for more new tokens than the engine's max_seq_len leaves: the output stops there
    (finish reason length), exit 0, and one note on stderr says why; none when it fits."""
    max_seq_len = json.loads((engine / "config.json").read_text())["build"]["max_seq_len"]
    r = invoke("run-engine", "--engine-dir", engine, "--input-text", "Hello there",
               "--max-output-len", 10 * max_seq_len)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "tokens, length)" in r.stdout
    (note,) = r.stderr.strip().splitlines()
    assert (
        note.startswith("note: request 0 reached the engine's max_seq_len")
        and "--max-seq-len" in note
    )
    r = invoke("run-engine", "--engine-dir", engine, "--input-text", "Hello there",
               "--max-output-len", 3)  # fmt: skip
    assert r.exit_code == 0 and "note:" not in r.stderr


def test_block_larger_than_a_sequence_builds_with_one_warning_line(ckpt, tmp_path):
    """A block past the smallest power of two that holds --max-seq-len wastes KV memory on
    every sequence: the build goes on, with one `warning:` line naming the block that fits."""
    flags = ("build-engine", "--checkpoint-dir", ckpt, "--target", "cpu", "--max-seq-len", "24")
    r = invoke(*flags, "--output-dir", tmp_path / "e64", "--tokens-per-block", "64")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1, r.stderr
    assert "--tokens-per-block 64 is larger than a whole sequence (--max-seq-len 24)" in warned[0]
    assert "at least 40 tokens unused" in warned[0] and "--tokens-per-block 32 holds" in warned[0]
    assert (tmp_path / "e64" / "config.json").is_file()
    # the smallest block that holds a sequence, and any smaller one: no warning
    for bs in ("32", "16"):
        r = invoke(*flags, "--output-dir", tmp_path / f"e{bs}", "--tokens-per-block", bs)
        assert r.exit_code == 0 and "warning:" not in r.stderr, r.output


def test_bad_flags(ckpt, engine, tmp_path):
    out = tmp_path / "e"
    assert_one_line_error(
        invoke("build-engine", "--checkpoint-dir", ckpt, "--output-dir", out, "--target", "tpu"),
        "tpu",
    )
    # an arch older than Ampere, or one this Triton cannot compile for (sm_110 failed in ptxas,
    # sm_130 aborted inside LLVM and left the build's temp dir behind)
    for arch, why in (("sm_75", "older than Ampere"), ("sm_110", "not a GPU arch"),
                      ("sm_130", "not a GPU arch")):  # fmt: skip
        r = invoke("build-engine", "--checkpoint-dir", ckpt, "--output-dir", out, "--target", arch)
        assert_one_line_error(r, f"--target {arch}: {why}", "sm_90")
    assert list(tmp_path.iterdir()) == []
    assert_one_line_error(
        invoke(
            "build-engine",
            "--checkpoint-dir",
            ckpt,
            "--output-dir",
            out,
            "--tokens-per-block",
            "12",
        ),
        "power of two",
    )
    r = invoke("build-engine", "--checkpoint-dir", ckpt, "--output-dir", out, "--max-seq-len", "1")
    assert_one_line_error(r, "--max-seq-len 1", "--max-seq-len 2 or more")
    assert list(tmp_path.iterdir()) == []
    assert_one_line_error(
        invoke(
            "build-engine",
            "--checkpoint-dir",
            ckpt,
            "--output-dir",
            out,
            "--config",
            "no-such-preset",
        ),
        "no-such-preset",
    )
    r = invoke("build-engine", "--checkpoint-dir", tmp_path / "nope", "--output-dir", out)
    assert_one_line_error(r, "checkpoint")
    assert r.stderr.startswith("error: ")  # no progress bar's blank line before it
    assert_one_line_error(
        invoke(
            "run-engine",
            "--engine-dir",
            engine,
            "--input-text",
            "x",
            "--max-output-len",
            "2",
            "--top-p",
            "1.5",
        ),
        "--top-p must be in (0, 1]",  # the flag, not the SamplingParams field
    )
    assert_one_line_error(
        invoke("run-engine", "--engine-dir", engine, "--input-text", "x", "--max-output-len", "0"),
        "--max-output-len must be > 0",
    )
    assert_one_line_error(  # a checkpoint where an engine belongs
        invoke("run-engine", "--engine-dir", ckpt, "--input-text", "x", "--max-output-len", "2"),
        "is an ingot checkpoint, not an engine",
        f"build-engine --checkpoint-dir {ckpt}",
    )
    for fraction in ("0", "1.5"):
        assert_one_line_error(
            invoke("run-engine", "--engine-dir", engine, "--input-text", "x",
                   "--max-output-len", "2", "--kv-cache-free-gpu-memory-fraction", fraction),
            "must be in (0, 1]",
        )  # fmt: skip
    assert_one_line_error(
        invoke(
            "run-engine",
            "--engine-dir",
            tmp_path / "none",
            "--input-text",
            "x",
            "--max-output-len",
            "2",
        ),
        "does not exist",
    )
    assert not out.exists()


def test_stop_words_and_input_file(engine, tmp_path):
    from ingot.runtime.llm import LLM
    from ingot.runtime.types import FinishReason, SamplingParams

    llm = LLM(engine)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    full = llm.generate(["The engine"], params)[0]
    assert full.finish_reason == FinishReason.LENGTH and len(full.text) > 4
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = llm.generate(
        ["The engine"], SamplingParams(max_new_tokens=12, ignore_eos=True, stop_words=(stop,))
    )[0]
    assert cut.finish_reason == FinishReason.STOP
    assert stop not in cut.text and full.text.startswith(cut.text)
    streamed: list[str] = []
    llm.generate(["The engine"], params, lambda i, delta: streamed.append(delta))
    assert "".join(streamed) == full.text
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    r = invoke(
        "run-engine", "--engine-dir", engine, "--input-file", prompts, "--max-output-len", "3"
    )
    assert r.exit_code == 0, r.output
    assert "[1] Output:" in r.stdout and "[2]" not in r.stdout


@pytest.mark.parametrize("kind", ["binary", "dir"])
def test_bad_input_file_is_one_line(engine, tmp_path, kind):
    """Bytes that are not UTF-8 were a crash report; a dir was said not to exist."""
    path = tmp_path / "prompts.txt"
    if kind == "dir":
        path.mkdir()
    else:
        path.write_bytes(b"a prompt\n\xf7\xff not text\n")
    r = invoke("run-engine", "--engine-dir", engine, "--input-file", path, "--max-output-len", "2")
    why = {"binary": "is not UTF-8 text (byte 0xf7 at offset 9)", "dir": "is a directory"}[kind]
    assert_one_line_error(r, f"--input-file {path} {why}", "UTF-8 text file")


def test_out_of_memory_is_one_line(engine, monkeypatch):
    import ingot.runtime.llm as llm_mod

    class OutOfMemoryError(RuntimeError):  # stands in for torch.OutOfMemoryError
        pass

    def boom(*a, **k):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(llm_mod, "Executor", boom)
    r = invoke("run-engine", "--engine-dir", engine, "--input-text", "x", "--max-output-len", "2")
    assert_one_line_error(r, "out of GPU memory", "--kv-cache-free-gpu-memory-fraction")


def test_kv_cache_too_large_for_host_memory_is_one_line(engine):
    """A KV pool the CPU allocator refuses (a plain RuntimeError from torch): one line naming
    the pool's size and the flag, exit 2; any other allocation failure: 'out of host memory'."""
    r = invoke("run-engine", "--engine-dir", engine, "--input-text", "x", "--max-output-len", "2",
               "--num-kv-blocks", str(10**12))  # fmt: skip
    assert_one_line_error(r, "KV cache of 1,000,000,000,000 blocks", "host memory",
                          "--num-kv-blocks")  # fmt: skip


def test_host_allocator_failure_is_one_line(engine, monkeypatch):
    import ingot.runtime.llm as llm_mod

    def boom(*a, **k):  # what torch's CPU allocator raises
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 409600008192 bytes.")  # fmt: skip

    monkeypatch.setattr(llm_mod, "Executor", boom)
    r = invoke("run-engine", "--engine-dir", engine, "--input-text", "x", "--max-output-len", "2")
    assert_one_line_error(r, "out of host memory", "can't allocate memory")


def test_corrupt_checkpoint_fails_the_build_with_one_line(ckpt, tmp_path):
    """The checkpoint's sha256 is checked beside the build's work (compiler/build.py:
    _verifying); a mismatch still fails it, with no engine left behind."""
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    data = bytearray((bad / "rank0.safetensors").read_bytes())
    data[-3] ^= 0xFF  # a weight byte (the end of the file), not the header
    (bad / "rank0.safetensors").write_bytes(bytes(data))
    r = invoke(
        "build-engine", "--checkpoint-dir", bad, "--output-dir", tmp_path / "e",
        "--target", "cpu", "--config", "tiny-llama",
    )  # fmt: skip
    assert_one_line_error(r, "does not match the sha256")
    assert not (tmp_path / "e").exists()


def test_sha256_stops_when_asked(tmp_path):
    import threading

    from ingot.runtime.integrity import sha256_file

    f = tmp_path / "blob"
    f.write_bytes(b"x" * 1000)
    stop = threading.Event()
    assert sha256_file(f, stop) is not None
    stop.set()
    assert sha256_file(f, stop) is None


def test_pdl_default_follows_target_and_quantization():
    from ingot.compiler.build import resolve_build_config
    from ingot.runtime.config import QuantConfig

    plain, fp8 = QuantConfig(), QuantConfig(mode="fp8", kv_cache_dtype="fp8")
    kv_only, int4 = QuantConfig(kv_cache_dtype="fp8"), QuantConfig(mode="int4_awq")
    for q in (plain, kv_only, fp8):
        assert resolve_build_config(None, {"target": "sm_90"}, quant=q).pdl
        assert not resolve_build_config(None, {"target": "sm_80"}, quant=q).pdl
        assert not resolve_build_config(None, {"target": "cpu"}, quant=q).pdl
    assert not resolve_build_config(None, {"target": "sm_90"}, quant=int4).pdl  # INT4: opt-in
    for q in (fp8, int4):
        # an explicit choice wins either way (FP8 was refused before its cause was found)
        assert resolve_build_config(None, {"target": "sm_90", "pdl": True}, quant=q).pdl
    assert not resolve_build_config(None, {"target": "sm_90", "pdl": False}, quant=plain).pdl
