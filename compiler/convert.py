"""HF model dir -> ingot checkpoint: map names, fuse q/k/v and gate/up, cast, write atomically."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ingot.runtime.config import ModelConfig
from ingot.runtime.errors import CheckpointError, ConfigError

from .atomic import atomic_output_dir, refuse_replacing_input
from .checkpoint import (
    TOKENIZER_DIR,
    TORCH_DTYPES,
    expected_tensor_shapes,
    fused_splits,
    write_checkpoint,
)
from .families import GLOBAL_TENSORS, HF_LAYER_PREFIX, IGNORED_HF_TENSORS, get_family
from .hf_config import model_config_from_hf
from .quantize import QuantOptions, check_request, quantize_checkpoint
from .shard import check_tp, shard_tensors

Progress = Callable[[str, int, int], None]
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "generation_config.json", "config.json",
)  # fmt: skip
INDEX_FILE = "model.safetensors.index.json"
_REDOWNLOAD = "re-download the model"


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of an HF model dir, with clear errors for a missing dir/file or bad JSON."""
    if not model_dir.is_dir():
        raise CheckpointError(
            f"model dir {model_dir} does not exist",
            hint="pass a local Hugging Face model dir to --model-dir",
        )
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir} has no config.json",
            hint="pass a Hugging Face model dir (config.json + *.safetensors)",
        )
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}", hint=_REDOWNLOAD) from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} is not a JSON object", hint=_REDOWNLOAD)
    return hf


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e}", hint=_REDOWNLOAD) from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names {f.name}, which is missing", hint=_REDOWNLOAD)
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        has_bin = any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt"))
        raise CheckpointError(
            f"{model_dir} has no *.safetensors weights"
            + (" (only .bin/.pt files)" if has_bin else ""),
            hint="ingot reads only safetensors (it never unpickles); re-save the model with "
            "save_pretrained(safe_serialization=True)",
        )
    return files


class _HFTensors:
    """Name -> memory-mapped tensor over all weight files; safetensors errors name the file."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        self._where: dict[str, tuple[Path, Any]] = {}
        for path in files:
            try:
                f = stack.enter_context(safe_open(str(path), framework="pt"))
                names = list(f.keys())
            except (SafetensorError, OSError) as e:
                raise _corrupt(path, e) from None
            for name in names:
                if name in self._where:
                    raise CheckpointError(
                        f"tensor {name} is in both {self._where[name][0].name} and {path.name}",
                        hint=_REDOWNLOAD,
                    )
                self._where[name] = (path, f)

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        path, f = self._where[name]
        try:
            return f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _corrupt(path, e) from None


def _corrupt(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read {path} (truncated or corrupt safetensors file): {e}", hint=_REDOWNLOAD
    )


def build_plan(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical name -> HF source names (fused when more than one), for every output tensor."""
    family = get_family(cfg.family)
    plan: dict[str, tuple[str, ...]] = {"embed.weight": (GLOBAL_TENSORS["embed.weight"],)}
    layer = family.layer_tensors(qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm)
    for i in range(cfg.num_layers):
        hf_prefix = HF_LAYER_PREFIX.format(i=i)
        for canonical, sources in layer.items():
            plan[f"layers.{i}.{canonical}"] = tuple(hf_prefix + s for s in sources)
    plan["final_norm.weight"] = (GLOBAL_TENSORS["final_norm.weight"],)
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (GLOBAL_TENSORS["lm_head.weight"],)
    return plan


def _check_names(plan: dict[str, tuple[str, ...]], available: set[str], cfg: ModelConfig) -> None:
    wanted = {s for sources in plan.values() for s in sources}
    ignored = {n for n in available if any(p.search(n) for p in IGNORED_HF_TENSORS)}
    if cfg.tie_word_embeddings:
        ignored.add(GLOBAL_TENSORS["lm_head.weight"])  # tied: a stored copy is dropped
    missing = sorted(wanted - available)
    unexpected = sorted(available - wanted - ignored)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(
                f"missing tensors {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "")
            )
        if unexpected:
            parts.append(
                f"unexpected tensors {', '.join(unexpected[:6])}"
                + (" ..." if len(unexpected) > 6 else "")
            )
        raise CheckpointError(
            f"weights do not match config.json ({cfg.architecture}): " + "; ".join(parts),
            hint="check the model dir is complete and matches its config",
        )


def _convert_tensor(
    canonical: str,
    sources: tuple[str, ...],
    hf: _HFTensors,
    cfg: ModelConfig,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    # Expected shape of each HF part: the canonical shape with its rows split per fused part.
    linear = canonical.rsplit(".", 1)[0].split(".", 2)[-1]
    rows = fused_splits(cfg).get(linear, (shape[0],)) if len(sources) > 1 else (shape[0],)
    parts = []
    for name, n in zip(sources, rows, strict=True):
        t = hf.get(name)
        want = (n, *shape[1:])
        if tuple(t.shape) != want:
            raise CheckpointError(
                f"tensor {name} has shape {list(t.shape)}, expected {list(want)} "
                f"for {cfg.architecture} per config.json",
                hint="check the model dir matches its config.json",
            )
        parts.append(t)
    # [sum(rows), ...]: rows q, k, v (or gate, up) in order, as docs/formats.md fixes.
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out.to(dtype).contiguous()


def _copy_tokenizer(model_dir: Path, dst: Path) -> list[str]:
    dst.mkdir()
    copied = []
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dst / name)
            copied.append(name)
    return copied


def _copy_loadable_tokenizer(model_dir: Path, dst: Path) -> None:
    """Copy the tokenizer files and load the copy as the engine will (runtime/llm.py
    load_tokenizer): a model dir whose tokenizer transformers cannot build fails here, before
    the slow work, instead of at run-engine."""
    from transformers import AutoTokenizer

    copied = _copy_tokenizer(model_dir, dst)
    try:
        AutoTokenizer.from_pretrained(str(dst))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"transformers cannot load a tokenizer from {model_dir} (its tokenizer files: "
            f"{', '.join(copied) or 'none'}): {str(e) or type(e).__name__}",
            hint="put the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
            "in the model dir",
        ) from None


def convert_checkpoint(
    model_dir: Path,
    output_dir: Path,
    dtype: str = "auto",
    force: bool = False,
    progress: Progress | None = None,
    quant: QuantOptions | None = None,
    tp_size: int = 1,
) -> Path:
    """Convert a local HF model dir into an ingot checkpoint at `output_dir`; return its path.

    tp_size: shard for tensor parallelism into rank{r}.safetensors (compiler/shard.py); must
    divide num_heads, num_kv_heads and intermediate_size; quantized checkpoints need tp 1.

    quant: quantize (FP8 / INT4 AWQ / FP8 KV cache) with ModelOpt calibration, and store the
    accuracy report (compiler/quantize). Raises CheckpointError (bad/unsupported input),
    ConfigError (bad dtype, paths or quantization request) and OutputExistsError (output holds
    an artifact and not `force`). Never leaves partial output.
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    quant = quant or QuantOptions()
    hf_config = read_hf_config(model_dir)
    cfg = model_config_from_hf(hf_config, dtype)
    check_request(cfg, quant)
    check_tp(cfg, tp_size)
    if tp_size > 1 and quant.active:
        raise ConfigError(
            f"--tp-size {tp_size} is not supported yet for quantized checkpoints",
            "convert with --tp-size 1, or without --quant / --kv-cache-dtype fp8",
        )
    refuse_replacing_input(output_dir, model_dir, "model dir")
    files = _weight_files(model_dir)
    plan = build_plan(cfg)
    shapes = expected_tensor_shapes(cfg)
    torch_dtype = TORCH_DTYPES[cfg.dtype]
    report = progress or (lambda desc, done, total: None)
    total = cfg.num_layers + 2
    with ExitStack() as stack:
        hf = _HFTensors(files, stack)
        _check_names(plan, hf.names(), cfg)
        with atomic_output_dir(output_dir, force, "checkpoint") as tmp:
            _copy_loadable_tokenizer(model_dir, tmp / TOKENIZER_DIR)
            tensors: dict[str, torch.Tensor] = {}
            for step, (desc, prefix) in enumerate(_steps(cfg)):
                report(desc, step, total)
                for canonical, sources in plan.items():
                    if _in_step(canonical, prefix):
                        tensors[canonical] = _convert_tensor(
                            canonical, sources, hf, cfg, shapes[canonical], torch_dtype
                        )
            quant_report = None
            if quant.active:
                tensors, quant_report = quantize_checkpoint(
                    model_dir, cfg, tensors, plan, quant, progress
                )
            report("writing checkpoint", total - 1, total)
            source = {"architecture": cfg.architecture, "model_type": hf_config.get("model_type")}
            write_checkpoint(
                tmp,
                cfg,
                tensors if tp_size == 1 else shard_tensors(cfg, tensors, tp_size),
                source=source,
                quant=quant.quant_config(),
                quant_report=quant_report,
            )
            report("done", total, total)
    return output_dir


def _steps(cfg: ModelConfig) -> list[tuple[str, str | None]]:
    steps: list[tuple[str, str | None]] = [("embeddings", None)]
    steps += [(f"layer {i + 1}/{cfg.num_layers}", f"layers.{i}.") for i in range(cfg.num_layers)]
    return steps


def _in_step(canonical: str, prefix: str | None) -> bool:
    return canonical.startswith(prefix) if prefix else not canonical.startswith("layers.")
