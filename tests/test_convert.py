"""convert_checkpoint, the checkpoint format and atomic output dirs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from ingot.compiler.atomic import atomic_output_dir
from ingot.compiler.checkpoint import expected_tensor_shapes, load_checkpoint, sha256_file
from ingot.compiler.convert import convert_checkpoint
from ingot.runtime.errors import CheckpointError, ConfigError, OutputExistsError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TEXTS = [
    "Hello, world!",
    "The kettle began to sing.",
    "Café crème — naïve résumé",
    "東京の朝 🚀 Привет",
    "  leading spaces\tand\ttabs\n",
    "def f(x): return x * 2",
]


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def converted(tiny_hf_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple, Path] = {}

    def get(family: str, dtype: str = "auto", **kw) -> tuple[Path, Path]:
        key = (family, dtype, tuple(sorted(kw.items())))
        hf = tiny_hf_dir(family, **kw)
        if key not in cache:
            cache[key] = convert_checkpoint(hf, tmp_path_factory.mktemp("ckpt") / "c", dtype=dtype)
        return hf, cache[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_canonical_names_and_fused_tensors(converted, family: str) -> None:
    hf_dir, ckpt = converted(family)
    meta, tensors = load_checkpoint(ckpt)
    cfg = meta["model"]
    assert meta["format"] == "ingot-checkpoint" and meta["format_version"] == 1
    assert meta["source"] == {"architecture": cfg.architecture, "model_type": family}
    shapes = expected_tensor_shapes(cfg)
    assert set(tensors) == set(shapes)
    assert all(tuple(tensors[n].shape) == s for n, s in shapes.items())
    assert cfg.dtype == "float32" and cfg.family == family
    hf = hf_tensors(hf_dir)
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(tensors[a + "attn.qkv.weight"], qkv)
        gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        assert torch.equal(tensors[a + "mlp.gate_up.weight"], gate_up)
        assert torch.equal(tensors[a + "mlp.down.weight"], hf[p + "mlp.down_proj.weight"])
        assert torch.equal(tensors[a + "attn.o.weight"], hf[p + "self_attn.o_proj.weight"])
        assert torch.equal(tensors[a + "attn_norm.weight"], hf[p + "input_layernorm.weight"])
        if family == "qwen2":
            bias = torch.cat([hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
            assert torch.equal(tensors[a + "attn.qkv.bias"], bias)
        if family == "qwen3":
            assert cfg.head_dim == 32 and cfg.qk_norm
            assert torch.equal(tensors[a + "attn.q_norm.weight"], hf[p + "self_attn.q_norm.weight"])
            assert torch.equal(tensors[a + "attn.k_norm.weight"], hf[p + "self_attn.k_norm.weight"])
    assert torch.equal(tensors["embed.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(tensors["lm_head.weight"], hf["lm_head.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_reproduces_source(converted, family: str) -> None:
    hf_dir, ckpt = converted(family)
    src = AutoTokenizer.from_pretrained(hf_dir)
    dst = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    assert type(dst) is type(src)
    assert (dst.bos_token_id, dst.eos_token_id) == (src.bos_token_id, src.eos_token_id)
    for text in TEXTS:
        ids = src(text).input_ids
        assert dst(text).input_ids == ids
        assert dst.decode(ids) == src.decode(ids)
        assert dst.decode(ids, skip_special_tokens=True) == text


def test_sharded_input_equals_single_file(converted) -> None:
    hf_dir, sharded = converted("qwen2", sharded=True)
    assert (hf_dir / "model.safetensors.index.json").is_file()
    _, single = converted("qwen2")
    assert (
        load_file(sharded / "rank0.safetensors").keys()
        == load_file(single / "rank0.safetensors").keys()
    )
    a, b = load_file(sharded / "rank0.safetensors"), load_file(single / "rank0.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tied_embeddings_drop_lm_head(converted) -> None:
    _, ckpt = converted("llama", tie_word_embeddings=True)
    meta, tensors = load_checkpoint(ckpt)
    assert meta["model"].tie_word_embeddings and "lm_head.weight" not in tensors


def test_tied_lm_head_copy_is_dropped(hf_copy, tmp_path: Path) -> None:
    hf = hf_copy("llama", tie_word_embeddings=True)
    t = load_file(hf / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    t["model.rotary_emb.inv_freq"] = torch.ones(8)  # old HF checkpoints carry this buffer
    save_file(t, str(hf / "model.safetensors"))
    _, tensors = load_checkpoint(convert_checkpoint(hf, tmp_path / "out"))
    assert "lm_head.weight" not in tensors


def test_llama3_rope_and_dtype_cast(converted) -> None:
    _, ckpt = converted("llama", dtype="bfloat16", rope_scaling_llama3=True)
    meta, tensors = load_checkpoint(ckpt)
    rope = meta["model"].rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "llama3",
        500000.0,
        8.0,
        64,
    )
    assert meta["model"].dtype == "bfloat16"
    assert all(tensors[n].dtype == torch.bfloat16 for n in tensors)
    assert meta["model"].eos_token_ids and meta["model"].bos_token_id is not None


# --- the checkpoint reader --------------------------------------------------------------------


def _copy_ckpt(converted, tmp_path: Path) -> Path:
    _, ckpt = converted("qwen2")
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _rewrite(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(ckpt / "rank0.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    config["rank_files"]["rank0.safetensors"] = sha256_file(ckpt / "rank0.safetensors")
    (ckpt / "config.json").write_text(json.dumps(config))


def test_reader_rejects_future_version(converted, tmp_path: Path) -> None:
    ckpt = _copy_ckpt(converted, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(format_version=99, ingot_version="9.9.0")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    assert "9.9.0" in e.value.one_line() and "upgrade" in e.value.one_line()


def test_reader_rejects_other_format_and_hash_mismatch(converted, tmp_path: Path) -> None:
    ckpt = _copy_ckpt(converted, tmp_path)
    with open(ckpt / "rank0.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not an ingot checkpoint"):
        load_checkpoint(ckpt)


def test_reader_names_missing_unexpected_and_misshaped(converted, tmp_path: Path) -> None:
    ckpt = _copy_ckpt(converted, tmp_path)
    good = load_file(ckpt / "rank0.safetensors")
    t = dict(good)
    del t["layers.1.attn.qkv.bias"]
    t["layers.0.extra.weight"] = torch.zeros(2)
    _rewrite(ckpt, t)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt)
    assert (
        "layers.1.attn.qkv.bias" in e.value.message and "layers.0.extra.weight" in e.value.message
    )
    t = dict(good)
    t["final_norm.weight"] = torch.zeros(63)
    _rewrite(ckpt, t)
    with pytest.raises(
        CheckpointError, match=r"final_norm.weight has shape \[63\], expected \[64\]"
    ):
        load_checkpoint(ckpt)


# --- bad inputs ---------------------------------------------------------------------------------


def test_missing_dir_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_invalid_json_and_unsupported_arch(hf_copy, tmp_path: Path) -> None:
    hf = hf_copy("llama")
    config = (hf / "config.json").read_text()
    (hf / "config.json").write_text(config[:-20])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        convert_checkpoint(hf, tmp_path / "out")
    d = json.loads(config)
    d["architectures"] = ["FalconForCausalLM"]
    (hf / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="Qwen3ForCausalLM"):
        convert_checkpoint(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_only_bin_weights(hf_copy, tmp_path: Path) -> None:
    hf = hf_copy("llama")
    (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(hf, tmp_path / "out")
    assert ".bin" in e.value.message and "only safetensors" in e.value.one_line()


@pytest.mark.parametrize("cut", [4, 40, 5000])
def test_truncated_safetensors(hf_copy, tmp_path: Path, cut: int) -> None:
    hf = hf_copy("llama")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) - cut] if cut > 100 else data[:cut])
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(hf, tmp_path / "out")
    assert "model.safetensors" in e.value.message and "re-download" in e.value.one_line()
    assert not (tmp_path / "out").exists()


def test_missing_unexpected_and_misshaped_hf_tensor(hf_copy, tmp_path: Path) -> None:
    hf = hf_copy("mistral")
    good = load_file(hf / "model.safetensors")
    t = dict(good)
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(t, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(hf, tmp_path / "out")
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in e.value.message
    assert "unexpected tensors model.layers.0.self_attn.o_proj.bias" in e.value.message
    t = dict(good)
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(t, str(hf / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"k_proj.weight has shape \[16, 64\], expected \[32, 64\]"
    ):
        convert_checkpoint(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_output_exists_kept_unless_force(tiny_hf_dir, tmp_path: Path) -> None:
    hf, out = tiny_hf_dir("llama"), tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(OutputExistsError) as e:
        convert_checkpoint(hf, out)
    assert "--force" in e.value.one_line() and (out / "precious.txt").read_text() == "keep me"
    convert_checkpoint(hf, out, force=True)
    assert not (out / "precious.txt").exists() and (out / "rank0.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or old dirs left


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupt_leaves_nothing_and_keeps_old(tiny_hf_dir, tmp_path: Path, exc: type) -> None:
    hf, out = tiny_hf_dir("llama"), tmp_path / "out"

    def boom(desc: str, done: int, total: int) -> None:
        if done == 2:
            raise exc()

    with pytest.raises(exc):
        convert_checkpoint(hf, out, progress=boom)
    assert list(tmp_path.iterdir()) == []
    convert_checkpoint(hf, out)
    before = sha256_file(out / "rank0.safetensors")
    with pytest.raises(exc):
        convert_checkpoint(hf, out, force=True, progress=boom)
    assert sha256_file(out / "rank0.safetensors") == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    load_checkpoint(out)


def test_output_inside_model_dir_refused(hf_copy) -> None:
    hf = hf_copy("llama")
    for out in (hf, hf.parent):  # the model dir, or a dir above it
        with pytest.raises(ConfigError, match="replace the model dir"):
            convert_checkpoint(hf, out, force=True)
    assert (hf / "model.safetensors").is_file()


def test_atomic_output_dir_refuses_file_and_allows_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputExistsError), atomic_output_dir(tmp_path / "f", True, "thing"):
        pass
    (tmp_path / "empty").mkdir()
    with atomic_output_dir(tmp_path / "empty", False, "thing") as tmp:
        (tmp / "a").write_text("a")
    assert (tmp_path / "empty" / "a").read_text() == "a"
