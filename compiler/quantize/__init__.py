"""Quantization at convert time (DESIGN.md decision 5): ModelOpt calibrates, ingot stores.

convert-checkpoint with --quant fp8|int4_awq (and/or --kv-cache-dtype fp8):
  1. `check_request` refuses bad requests before any work (mode, group size, calibration file,
     device support for FP8);
  2. `quantize_checkpoint` loads the HF model, scores the unquantized model on held-out text,
     calibrates with nvidia-modelopt (calibrate.py), turns ModelOpt's quantizers into ingot
     tensors (export.py with fp8.py / int4_awq.py), and scores ingot's own quantized CPU path
     against the unquantized scores (report.py).
The checkpoint layout is docs/formats.md "Quantized checkpoints"; build-engine repacks it with
`repack_for_engine` (layout.py). Importing this package does not import ModelOpt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ingot.runtime.config import QUANT_MODES, ModelConfig, QuantConfig
from ingot.runtime.errors import ConfigError
from ingot.runtime.user_files import read_user_text

from .layout import linear_shapes, repack_for_engine

Progress = Callable[[str, int, int], None]
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_CALIB_TEXT = DATA_DIR / "calib.txt"
DEVICES = ("auto", "cpu", "cuda")
FP8_MIN_CAPABILITY = (8, 9)

__all__ = [
    "QuantOptions",
    "check_request",
    "cuda_capability",
    "quantize_checkpoint",
    "repack_for_engine",
]


@dataclass(frozen=True)
class QuantOptions:
    """What convert-checkpoint was asked for. calib_dataset None: the shipped calib.txt."""

    mode: str = "none"
    kv_cache_dtype: str = "auto"
    calib_dataset: Path | None = None
    calib_size: int = 32
    calib_max_seq_len: int = 512
    device: str = "auto"
    group_size: int = 128
    lm_head: bool = False

    @property
    def active(self) -> bool:
        return self.mode != "none" or self.kv_cache_dtype == "fp8"

    def quant_config(self) -> QuantConfig:
        return QuantConfig(self.mode, self.kv_cache_dtype, self.group_size, self.lm_head)


def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of this machine's first CUDA GPU, None without one (tests patch this)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if cuda_capability() is not None else "cpu"
    return device


def check_request(cfg: ModelConfig, opts: QuantOptions) -> None:
    """Raise ConfigError (one line, with a hint) for a request that cannot be served."""
    if opts.mode not in QUANT_MODES:
        raise ConfigError(
            f"unknown --quant {opts.mode!r}", f"choose one of {', '.join(QUANT_MODES)}"
        )
    if opts.kv_cache_dtype not in ("auto", "fp8"):
        raise ConfigError(f"unknown --kv-cache-dtype {opts.kv_cache_dtype!r}", "use auto or fp8")
    if opts.device not in DEVICES:
        raise ConfigError(f"unknown --device {opts.device!r}", "use auto, cpu or cuda")
    if opts.lm_head and opts.mode not in ("fp8", "int4_awq"):
        raise ConfigError(
            f"--quant-lm-head needs --quant fp8 or int4_awq (got --quant {opts.mode})",
            "add --quant fp8 or --quant int4_awq, or leave --quant-lm-head out",
        )
    if not opts.active:
        if opts.calib_dataset is not None:
            raise ConfigError(
                "--calib-dataset has no effect without quantization",
                "add --quant fp8|int4_awq or --kv-cache-dtype fp8",
            )
        return
    for flag, v in (
        ("--calib-size", opts.calib_size),
        ("--calib-max-seq-len", opts.calib_max_seq_len),
    ):
        if v <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {v}")
    if opts.calib_max_seq_len < 2:  # one token has no next token to calibrate or score on
        raise ConfigError(
            f"--calib-max-seq-len {opts.calib_max_seq_len} is too short: a calibration "
            "sequence needs at least 2 tokens",
            "use --calib-max-seq-len 2 or more (default 512)",
        )
    if opts.mode == "int4_awq":
        for name, (_, k) in linear_shapes(cfg).items():
            if k % opts.group_size:
                raise ConfigError(
                    f"layer layers.0.{name} has input size {k}, which is not a multiple of the "
                    f"INT4 AWQ group size {opts.group_size}",
                    "use --quant fp8 or --quant none for this model",
                )
    if opts.calib_dataset is not None:
        calib_file_text(opts.calib_dataset)  # fails before the model loads
    device = resolve_device(opts.device)
    cap = cuda_capability()
    fp8 = opts.mode == "fp8" or opts.lm_head
    if fp8 and device == "cuda" and (cap is None or cap < FP8_MIN_CAPABILITY):
        found = (
            "this machine has no CUDA GPU" if cap is None else f"this GPU is sm_{cap[0]}{cap[1]}"
        )
        what = "FP8" if opts.mode == "fp8" else "an FP8 lm_head (--quant-lm-head)"
        raise ConfigError(
            f"{what} needs a GPU with compute capability 8.9 or newer (Ada, Hopper); {found}",
            "use --quant int4_awq (without --quant-lm-head) or --quant none, or --device cpu "
            "to calibrate on the CPU",
        )
    if device == "cuda" and cap is None:
        raise ConfigError(
            "--device cuda was asked for but this machine has no CUDA GPU", "use --device cpu"
        )


def calib_file_text(path: Path) -> str:
    """A --calib-dataset file's text; missing, unreadable, non-UTF-8 or blank: ConfigError."""
    text = read_user_text(
        path,
        f"calibration file {path}",
        "pass a UTF-8 text file to --calib-dataset, or leave it out to use the shipped text",
    )
    if not text.strip():
        raise ConfigError(
            f"calibration file {path} is empty", "pass a text file with representative prose"
        )
    return text


def quantize_checkpoint(
    model_dir: Path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    plan: dict[str, tuple[str, ...]],
    opts: QuantOptions,
    progress: Progress | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Calibrate the HF model in `model_dir` and return (checkpoint tensors, accuracy report).

    `tensors` are the unquantized canonical tensors; `plan` maps canonical names to HF names
    (convert.build_plan). Quantized linears are replaced and scales added per docs/formats.md.
    """
    from ingot.runtime.timing import Lap

    from . import calibrate, export, report

    report_fn = progress or (lambda desc, done, total: None)
    device = resolve_device(opts.device)
    seconds: dict[str, float] = {}  # per phase, kept in the report (where a convert's time goes)
    lap = Lap(seconds, torch.device(device))
    text = calibrate.calibration_text(opts.calib_dataset)
    model, tokenizer = calibrate.load_hf_model(model_dir, device, cfg)
    samples = calibrate.token_windows(tokenizer, text, opts.calib_size, opts.calib_max_seq_len)
    if not samples:
        raise ConfigError(
            "the calibration text gives no sequence of 2 or more tokens "
            f"({opts.calib_dataset or DEFAULT_CALIB_TEXT})",
            "pass a text file with representative prose",
        )
    held_out = report.held_out_windows(tokenizer, calibrate.held_out_text())
    lap("load_model")
    reference = report.reference_logits(model, held_out, report_fn)
    lap("score_unquantized")
    calibrate.calibrate(model, opts, samples, report_fn)
    lap("calibrate")
    quant = opts.quant_config()
    out = export.export_tensors(model, cfg, quant, tensors, plan, report_fn)
    lap("export")
    rep = report.accuracy_report(cfg, quant, out, tensors, held_out, reference, report_fn)
    lap("accuracy_report")
    rep["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    rep["reference"] = (
        f"transformers {cfg.architecture}, unquantized, {next(model.parameters()).dtype} "
        f"on {device}"
    )
    rep["calibration"] = {
        "text": str(opts.calib_dataset) if opts.calib_dataset else "shipped calib.txt (first 75%)",
        "samples": len(samples),
        "tokens": int(sum(s.numel() for s in samples)),
        "device": device,
        "tool": calibrate.modelopt_version(),
    }
    return out, rep
