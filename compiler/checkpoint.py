"""The ingot checkpoint format (docs/formats.md): config.json + rank{N}.safetensors + tokenizer/."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ingot.runtime.config import ModelConfig, QuantConfig
from ingot.runtime.distributed import check_tp, padded_vocab
from ingot.runtime.errors import CheckpointError
from ingot.runtime.integrity import sha256_file
from ingot.runtime.version import CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, INGOT_VERSION

from .quantize.layout import checkpoint_layout

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZABLE_LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
_RECONVERT = "re-run `ingot convert-checkpoint`"


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def fused_splits(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Row counts of each part of a fused tensor, in order (qkv: q, k, v; gate_up: gate, up)."""
    return {
        "attn.qkv": (cfg.q_size, cfg.kv_size, cfg.kv_size),
        "mlp.gate_up": (cfg.intermediate_size, cfg.intermediate_size),
    }


def expected_tensor_shapes(cfg: ModelConfig, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor of an unquantized checkpoint for `cfg` (tp > 1:
    of one rank's file, compiler/shard.py)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    v = padded_vocab(cfg.vocab_size, tp) // tp
    i_size, q_size, qkv_size = cfg.intermediate_size // tp, cfg.q_size // tp, cfg.qkv_size // tp
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, d)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "attn.qkv.weight"] = (qkv_size, d)
        if cfg.qkv_bias:
            shapes[p + "attn.qkv.bias"] = (qkv_size,)
        if cfg.qk_norm:
            shapes[p + "attn.q_norm.weight"] = (hd,)
            shapes[p + "attn.k_norm.weight"] = (hd,)
        shapes[p + "attn.o.weight"] = (d, q_size)
        shapes[p + "mlp_norm.weight"] = (d,)
        shapes[p + "mlp.gate_up.weight"] = (2 * i_size, d)
        shapes[p + "mlp.down.weight"] = (d, i_size)
    shapes["final_norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def write_checkpoint(
    out_dir: Path,
    model: ModelConfig,
    tensors: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    *,
    source: dict[str, Any],
    quant: QuantConfig | None = None,
    quant_report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write rank{r}.safetensors and config.json into `out_dir` (an atomic temp dir); return
    config. tensors: one dict (tp 1) or one per rank (compiler/shard.py).

    quant_report: the accuracy report of a quantized checkpoint (compiler/quantize/report.py).
    """
    quant = quant or QuantConfig()
    ranks = tensors if isinstance(tensors, list) else [tensors]
    rank_files = {}
    for r, rank_tensors in enumerate(ranks):
        name = rank_file(r)
        save_file(
            {k: t.contiguous() for k, t in rank_tensors.items()},
            str(out_dir / name),
            metadata={"format": CHECKPOINT_FORMAT},
        )
        rank_files[name] = sha256_file(out_dir / name)
    config = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "ingot_version": INGOT_VERSION,
        "model": model.to_dict(),
        "quant": quant.to_dict(),
        "tp_size": len(ranks),
        "source": source,
        "rank_files": rank_files,
    }
    if len(ranks) > 1:
        config["padded_vocab_size"] = padded_vocab(model.vocab_size, len(ranks))
    if quant_report is not None:
        config["quant_report"] = quant_report
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return config


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """Memory-mapped, read-only view of one rank file; tensors are read on access."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt")
            self._names = list(self._f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path}: {e}", hint=_RECONVERT) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._f.get_slice(name).get_dtype()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _read_config(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not an ingot checkpoint (no {CONFIG_FILE})",
            hint="create one with `ingot convert-checkpoint`",
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}", hint=_RECONVERT) from None
    if not isinstance(config, dict) or config.get("format") != CHECKPOINT_FORMAT:
        found = config.get("format") if isinstance(config, dict) else None
        raise CheckpointError(
            f"{ckpt_dir} is not an ingot checkpoint (format {found!r})",
            hint="pass a dir written by `ingot convert-checkpoint`",
        )
    version = config.get("format_version")
    if version != CHECKPOINT_FORMAT_VERSION:
        writer = config.get("ingot_version", "an unknown version")
        newer = isinstance(version, int) and version > CHECKPOINT_FORMAT_VERSION
        raise CheckpointError(
            f"{ckpt_dir} has checkpoint format version {version} (written by ingot {writer}); "
            f"this ingot {INGOT_VERSION} reads version {CHECKPOINT_FORMAT_VERSION}",
            hint=f"upgrade ingot to {writer} or newer, or {_RECONVERT}" if newer else _RECONVERT,
        )
    return config


def _check_tensors(
    tensors: CheckpointTensors, model: ModelConfig, quant: QuantConfig, tp: int = 1
) -> None:
    expected = expected_tensor_shapes(model, tp)
    # Quantized linears keep X.weight (another dtype/shape) and add scales beside it.
    quantized = checkpoint_layout(model, quant)
    names = set(tensors)
    missing = [n for n in [*expected, *quantized] if n not in names]
    unexpected = sorted(names - expected.keys() - quantized.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(
                f"unexpected {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else "")
            )
        raise CheckpointError(f"{tensors.path}: {'; '.join(parts)}", hint=_RECONVERT)
    want_dtype = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[model.dtype]
    for name, (shape, dtype) in quantized.items():
        found = tensors.shape(name)
        if found != shape or tensors.dtype_name(name) != dtype:
            raise CheckpointError(
                f"{tensors.path}: quantized tensor {name} is {tensors.dtype_name(name)} "
                f"{list(found)}, expected {dtype} {list(shape)} for quant mode {quant.mode}",
                hint=_RECONVERT,
            )
    for name, shape in expected.items():
        if name in quantized:
            continue  # checked above
        found = tensors.shape(name)
        if found != shape:
            raise CheckpointError(
                f"{tensors.path}: tensor {name} has shape {list(found)}, expected {list(shape)}",
                hint=_RECONVERT,
            )
        if tensors.dtype_name(name) != want_dtype:
            raise CheckpointError(
                f"{tensors.path}: tensor {name} is {tensors.dtype_name(name)}, "
                f"expected {want_dtype}",
                hint=_RECONVERT,
            )


def verify_rank_file(ckpt_dir: Path, rank: int = 0, stop: threading.Event | None = None) -> None:
    """Raise CheckpointError unless rank `rank`'s tensor file has the sha256 config.json
    records (build-engine runs this beside its other work: ~16 s for 16 GB). Setting `stop`
    ends it early, unchecked."""
    ckpt_dir = Path(ckpt_dir)
    name = rank_file(rank)
    path = ckpt_dir / name
    want = _read_config(ckpt_dir).get("rank_files", {}).get(name)
    got = sha256_file(path, stop)
    if got is not None and want != got:
        raise CheckpointError(
            f"{path} does not match the sha256 in {CONFIG_FILE} (corrupt or edited)",
            hint=_RECONVERT,
        )


def load_checkpoint(
    ckpt_dir: Path, *, verify_hash: bool = True, rank: int = 0
) -> tuple[dict[str, Any], CheckpointTensors]:
    """Read and check a checkpoint dir.

    Returns (meta, tensors): meta is config.json with "model" a ModelConfig, "quant" a
    QuantConfig and "tp_size" an int; tensors a lazy name -> tensor mapping of rank `rank`.
    Raises CheckpointError on a wrong format or version, a hash mismatch, or
    missing/unexpected/mis-shaped tensors.
    """
    ckpt_dir = Path(ckpt_dir)
    config = _read_config(ckpt_dir)
    meta = dict(config)
    meta["model"] = ModelConfig.from_dict(config["model"])
    meta["quant"] = QuantConfig.from_dict(config.get("quant", {}))
    tp = config.get("tp_size", 1)
    if not isinstance(tp, int) or not 0 <= rank < tp:
        raise CheckpointError(
            f"{ckpt_dir}: tp_size {tp!r} in {CONFIG_FILE} has no rank {rank}", hint=_RECONVERT
        )
    check_tp(meta["model"], tp)
    meta["tp_size"] = tp
    name = rank_file(rank)
    path = ckpt_dir / name
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} lacks {name}", hint=_RECONVERT)
    if verify_hash:
        verify_rank_file(ckpt_dir, rank)
    tensors = CheckpointTensors(path)
    _check_tensors(tensors, meta["model"], meta["quant"], tp)
    return meta, tensors
