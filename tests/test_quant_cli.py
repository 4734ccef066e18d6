"""Quantized convert -> build -> inspect -> run through the CLI, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_checks import assert_one_line_error, invoke
from safetensors.torch import load_file

from ingot.plugins.quant.reference import pack_w4_engine, unpack_int4
from ingot.runtime.errors import ConfigError

pytest.importorskip("modelopt.torch.quantization")

SIZES = {"hidden_size": 128, "intermediate_size": 256}  # K a multiple of group size 128
CALIB = ("--calib-size", "4", "--calib-max-seq-len", "64", "--device", "cpu")


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    from ingot.compiler.examples import make_tiny_hf_model

    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qhf") / "hf", seed=5, **SIZES)


@pytest.fixture(scope="module")
def ckpts(hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qckpt")
    out = {}
    for key, args in (
        ("fp8", ("--quant", "fp8", "--kv-cache-dtype", "fp8")),
        ("int4_awq", ("--quant", "int4_awq")),
        ("fp8_lm_head", ("--quant", "fp8", "--quant-lm-head")),
        ("int4_awq_lm_head", ("--quant", "int4_awq", "--quant-lm-head")),
    ):
        out[key] = root / key
        r = invoke("convert-checkpoint", "--model-dir", hf, "--output-dir", out[key], *args, *CALIB)
        assert r.exit_code == 0, r.output
        assert "top-1 agreement" in r.stdout and "mean KL" in r.stdout
        assert "quantization took" in r.stdout and "calibrate" in r.stdout  # its phases
    return out


@pytest.mark.parametrize("key", ["fp8", "int4_awq", "fp8_lm_head", "int4_awq_lm_head"])
def test_quantized_checkpoint_builds_inspects_and_runs(ckpts, key, tmp_path):
    mode = key.removesuffix("_lm_head")
    engine = tmp_path / "engine"
    r = invoke(
        "build-engine", "--checkpoint-dir", ckpts[key], "--output-dir", engine,
        "--target", "cpu", "--max-seq-len", "64", "--max-batch-size", "4", "--max-kl", "1.0",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads((engine / "config.json").read_text())
    assert d["quant"]["mode"] == mode and "quant_report" in d["extra"]
    names = {p["name"] for p in d["plugins"]}
    gemm = {"fp8": "fp8_gemm", "int4_awq": "w4a16_gemm"}
    lm_head = key.endswith("_lm_head")  # an FP8 lm_head runs fp8_gemm in any mode
    assert names & set(gemm.values()) == {gemm[mode]} | ({"fp8_gemm"} if lm_head else set())
    r = invoke("inspect-engine", engine)
    assert r.exit_code == 0, r.output
    assert f"quantization  {mode}" in r.stdout and "top-1 agreement" in r.stdout
    assert d["quant"]["lm_head"] == lm_head
    assert ("lm_head FP8 too" in r.stdout) == lm_head
    r = invoke(
        "run-engine", "--engine-dir", engine, "--input-text", "The ferry left",
        "--input-text", "Bread asks for", "--max-output-len", "6",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "[0] Output:" in r.stdout and "[1] Output:" in r.stdout


def test_int4_engine_holds_the_repacked_layout(ckpts, tmp_path):
    from ingot.runtime.engine import load_engine

    engine = tmp_path / "engine"
    r = invoke("build-engine", "--checkpoint-dir", ckpts["int4_awq"], "--output-dir", engine,
                "--target", "cpu", "--max-seq-len", "64")  # fmt: skip
    assert r.exit_code == 0, r.output
    loaded = load_engine(engine)
    w = loaded.weights()
    ckpt = {}
    for f in sorted(Path(ckpts["int4_awq"]).glob("*.safetensors")):
        ckpt.update(load_file(f))
    name = "layers.0.mlp.down.weight"
    assert tuple(w[name].shape) == (128, 256 // 8)  # [N, K/8], codes interleaved per 128 k
    assert torch.equal(w[name], pack_w4_engine(unpack_int4(ckpt[name])))
    assert not torch.equal(w[name], ckpt[name])
    assert torch.equal(w[name + "_scale"], ckpt[name + "_scale"])  # [N, K/G]
    versions = {p.name: p.version for p in loaded.config.plugins}
    assert versions["w4a16_gemm"] == 2  # the layout is the plugin's version


def test_max_kl_refuses_and_leaves_nothing(ckpts, tmp_path):
    out = tmp_path / "engine"
    r = invoke("build-engine", "--checkpoint-dir", ckpts["int4_awq"], "--output-dir", out,
                "--target", "cpu", "--max-kl", "1e-9")  # fmt: skip
    assert_one_line_error(r, "mean KL", "exceeds --max-kl")
    assert not out.exists()


def test_max_kl_without_a_report(hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert invoke("convert-checkpoint", "--model-dir", hf, "--output-dir", ckpt).exit_code == 0
    r = invoke("build-engine", "--checkpoint-dir", ckpt, "--output-dir", tmp_path / "e",
                "--target", "cpu", "--max-kl", "0.1")  # fmt: skip
    assert_one_line_error(r, "no", "accuracy report")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("key", ["fp8", "int4_awq_lm_head"])
def test_fp8_engine_for_a_gpu_without_fp8_is_refused(ckpts, tmp_path, key):
    r = invoke("build-engine", "--checkpoint-dir", ckpts[key], "--output-dir",
                tmp_path / "e", "--target", "sm_80")  # fmt: skip
    assert_one_line_error(r, "SM >= 89", "FP8 weights")
    assert not (tmp_path / "e").exists()


def test_quantized_engines_cross_build_for_sm_90(ckpts, tmp_path):
    pytest.importorskip("triton", reason="cross-building GPU engines needs triton installed")
    for key in ("fp8", "int4_awq", "fp8_lm_head", "int4_awq_lm_head"):
        mode = key.removesuffix("_lm_head")
        out = tmp_path / key
        r = invoke("build-engine", "--checkpoint-dir", ckpts[key], "--output-dir", out,
                   "--target", "sm_90", "--tactics", "default")  # fmt: skip
        assert r.exit_code == 0, r.output
        d = json.loads((out / "config.json").read_text())
        names = {p["name"] for p in d["plugins"]}
        assert ("fp8_gemm" if mode == "fp8" else "w4a16_gemm") in names
        fused = {"rms_norm_quant_fp8", "swiglu_quant_fp8"}  # FP8 engines only
        assert fused <= names if mode == "fp8" else not fused & names
        assert d["extra"]["kernels"] > 0 and (out / "kernels.bin").is_file()
        # FP8: the attention kernels quantize their output for the o projection (an out scale)
        from ingot.plugins import aot

        kernels = aot.bundle_manifest((out / "kernels.bin").read_bytes())["kernels"]
        attn = [k for k in kernels if k["name"] in ("_decode_kernel", "_prefill_kernel")]
        assert {k["name"] for k in attn} == {"_decode_kernel", "_prefill_kernel"}
        quant_out = {k["signature"]["os_ptr"] == "*fp32" for k in attn}
        assert quant_out == ({True} if mode == "fp8" else {False})


@pytest.mark.parametrize("key", ["fp8", "int4_awq_lm_head"])
def test_fp8_fast_accum_is_set_on_every_fp8_gemm_plugin(ckpts, tmp_path, key):
    """--fp8-fast-accum (cross-built, default tactics): each FP8 GEMM plugin's tactic carries
    fast_accum with the plugin's fixed floor (nothing timed it), nothing else does, the build
    records it and inspect-engine shows it."""
    pytest.importorskip("triton", reason="cross-building GPU engines needs triton installed")
    from ingot.compiler.fast_accum import FP8_CUBLASLT_PLUGINS

    out = tmp_path / "e"
    r = invoke("build-engine", "--checkpoint-dir", ckpts[key], "--output-dir", out,
               "--target", "sm_90", "--tactics", "default", "--fp8-fast-accum")  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads((out / "config.json").read_text())
    assert d["build"]["fp8_fast_accum"] is True
    fast = {p["name"] for p in d["plugins"] if (p["params"] or {}).get("fast_accum")}
    present = {p["name"] for p in d["plugins"]} & set(FP8_CUBLASLT_PLUGINS)
    assert fast == present and "fp8_gemm" in fast
    assert all(p["tactic"] for p in d["plugins"] if p["name"] in fast)  # defaults named
    assert not any("fast_accum_rows" in (p["params"] or {}) for p in d["plugins"])
    r = invoke("inspect-engine", "--engine-dir", out)
    assert r.exit_code == 0 and "FP8 GEMMs with fast accumulation" in r.output


def test_fp8_fast_accum_refuses_an_engine_without_fp8_gemms(ckpts, tmp_path):
    for key, target, words in (("int4_awq", "sm_90", ("applies to FP8 GEMMs", "int4_awq")),
                               ("fp8", "cpu", ("fp8_fast_accum", "GPU target"))):  # fmt: skip
        r = invoke("build-engine", "--checkpoint-dir", ckpts[key], "--output-dir",
                   tmp_path / key, "--target", target, "--fp8-fast-accum")  # fmt: skip
        assert_one_line_error(r, *words)
        assert not (tmp_path / key).exists()


def _convert(hf: Path, out: Path, *args):
    return invoke("convert-checkpoint", "--model-dir", hf, "--output-dir", out, *args)


def test_unknown_quant(hf, tmp_path):
    assert_one_line_error(_convert(hf, tmp_path / "o", "--quant", "int3"), "int3", "int4_awq")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--calib-size", "0"), ("--calib-size must be a positive integer, got 0",)),
        (("--calib-max-seq-len", "-4"), ("--calib-max-seq-len must be a positive integer",)),
        # one-token sequences were all dropped, and the line blamed the text for having none
        (("--calib-max-seq-len", "1"), ("--calib-max-seq-len 1 is too short", "2 or more")),
    ],
)
def test_bad_calibration_sizes(hf, tmp_path, flags, words):
    assert_one_line_error(_convert(hf, tmp_path / "o", "--quant", "fp8", *flags), *words)
    assert not (tmp_path / "o").exists()


def test_quant_lm_head_needs_a_quant_mode(hf, tmp_path):
    r = _convert(hf, tmp_path / "o", "--quant-lm-head", *CALIB)
    assert_one_line_error(r, "--quant-lm-head needs --quant fp8 or int4_awq", "--quant none")
    assert not (tmp_path / "o").exists()


def test_group_size_mismatch_names_the_layer(tiny_hf_dir, tmp_path):
    # The default tiny model has hidden size 64, not a multiple of the group size 128.
    r = _convert(tiny_hf_dir("llama"), tmp_path / "o", "--quant", "int4_awq", *CALIB)
    assert_one_line_error(r, "layers.0.attn.qkv", "input size 64", "group size 128")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["missing", "empty", "dir", "binary"])
def test_bad_calibration_file(hf, tmp_path, kind):
    path = tmp_path / "calib.txt"
    if kind == "empty":
        path.write_text("  \n\n")
    if kind == "dir":
        path.mkdir()
    if kind == "binary":
        path.write_bytes(b"\x80abc")
    r = _convert(hf, tmp_path / "o", "--quant", "fp8", "--calib-dataset", path)
    why = {"missing": "does not exist", "empty": "is empty", "dir": "is a directory",
           "binary": "is not UTF-8 text (byte 0x80 at offset 0)"}[kind]  # fmt: skip
    assert_one_line_error(r, str(path), why)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("capability", [(8, 6), None])
@pytest.mark.parametrize("quant", [("fp8",), ("int4_awq", "--quant-lm-head")])
def test_fp8_on_a_gpu_without_fp8(hf, tmp_path, monkeypatch, capability, quant):
    import ingot.compiler.quantize as quantize

    monkeypatch.setattr(quantize, "cuda_capability", lambda: capability)
    r = _convert(hf, tmp_path / "o", "--quant", *quant, "--device", "cuda")
    what = "FP8" if quant == ("fp8",) else "an FP8 lm_head (--quant-lm-head)"
    needles = (what, "8.9", "int4_awq", "none", "sm_86" if capability else "no CUDA GPU")
    assert_one_line_error(r, *needles)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", [b"\xff\xfe", b" \n"])
def test_calibration_text_rechecks_a_file_changed_after_validation(tmp_path, bad):
    # validate() read the file; calibration reads it again later, after the model loads
    from ingot.compiler.quantize import calibrate

    path = tmp_path / "calib.txt"
    path.write_text("fine prose\n")
    assert calibrate.calibration_text(path) == "fine prose\n"
    path.write_bytes(bad)
    with pytest.raises(ConfigError, match="calibration file .*(not UTF-8|is empty)"):
        calibrate.calibration_text(path)
