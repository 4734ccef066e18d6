"""`ingot convert-checkpoint` through the CLI: clean success, one-line errors, no partial output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ingot.cli.main import app


def invoke(*args: str | Path):
    return CliRunner().invoke(app, ["convert-checkpoint", *map(str, args)])


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output + result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_convert_ok_then_refuse_then_force(tiny_hf_dir, tmp_path: Path) -> None:
    hf, out = tiny_hf_dir("qwen3"), tmp_path / "ckpt"
    result = invoke("--model-dir", hf, "--output-dir", out, "--dtype", "float16")
    assert result.exit_code == 0, result.output + result.stderr
    assert f"wrote checkpoint to {out}" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert (
        config["model"]["dtype"] == "float16" and (out / "tokenizer" / "tokenizer.json").is_file()
    )
    before = (out / "rank0.safetensors").stat().st_mtime_ns
    assert_one_line_error(
        invoke("--model-dir", hf, "--output-dir", out), "already holds a checkpoint", "--force"
    )
    assert (out / "rank0.safetensors").stat().st_mtime_ns == before
    assert invoke("--model-dir", hf, "--output-dir", out, "--force").exit_code == 0


def test_bad_dtype(tiny_hf_dir, tmp_path: Path) -> None:
    result = invoke(
        "--model-dir", tiny_hf_dir("llama"), "--output-dir", tmp_path / "o", "--dtype", "int4"
    )
    assert_one_line_error(result, "int4", "bfloat16", "float32")
    assert not (tmp_path / "o").exists()


def _break(kind: str, hf: Path) -> str:
    """Damage a copied HF dir one way; return a string the error line must contain."""
    if kind == "no_dir":
        return "does not exist"
    if kind == "no_config":
        (hf / "config.json").unlink()
        return "no config.json"
    if kind == "bad_json":
        (hf / "config.json").write_text("{not json")
        return "not valid JSON"
    if kind == "arch":
        d = json.loads((hf / "config.json").read_text())
        d["architectures"] = ["BertModel"]
        (hf / "config.json").write_text(json.dumps(d))
        return "LlamaForCausalLM"
    if kind == "only_bin":
        (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
        return "only safetensors"
    if kind == "truncated":
        data = (hf / "model.safetensors").read_bytes()
        (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
        return "re-download"
    if kind == "shape":
        d = json.loads((hf / "config.json").read_text())
        d["intermediate_size"] = 96
        (hf / "config.json").write_text(json.dumps(d))
        return "gate_proj.weight has shape [128, 64], expected [96, 64]"
    if kind == "no_tokenizer":  # run-engine could not tokenize: refused before the weights
        (hf / "tokenizer.json").unlink()
        return "transformers cannot load a tokenizer from"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["no_dir", "no_config", "bad_json", "arch", "only_bin", "truncated", "shape", "no_tokenizer"],
)
def test_bad_inputs_fail_in_one_line(hf_copy, tmp_path: Path, kind: str) -> None:
    hf = tmp_path / "missing" if kind == "no_dir" else hf_copy("llama")
    needle = _break(kind, hf)
    out = tmp_path / "out"
    assert_one_line_error(invoke("--model-dir", hf, "--output-dir", out), needle)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
