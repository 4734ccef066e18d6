"""Calibration with nvidia-modelopt: load the HF model, make token windows, run mtq.quantize.

ModelOpt replaces each nn.Linear with a QuantLinear (weight_quantizer, input_quantizer) and
each attention with a version whose k_bmm_quantizer / v_bmm_quantizer see K (after RoPE) and
V as they enter the cache; calibration fills their amax (and AWQ's pre_quant_scale).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ingot.runtime.config import ModelConfig
from ingot.runtime.errors import ConfigError

from . import DEFAULT_CALIB_TEXT, QuantOptions, calib_file_text

Progress = Callable[[str, int, int], None]
CALIB_FRACTION = 0.75  # the shipped text: calibration reads the head, the report the tail


def _split_shipped() -> tuple[str, str]:
    text = DEFAULT_CALIB_TEXT.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    cut = int(len(lines) * CALIB_FRACTION)
    return "".join(lines[:cut]), "".join(lines[cut:])


def calibration_text(path: Path | None) -> str:
    # read again through the checked reader: a file changed since validation is one clear line
    return calib_file_text(Path(path)) if path else _split_shipped()[0]


def held_out_text() -> str:
    """The shipped text's last quarter: never seen by calibration from the shipped text."""
    return _split_shipped()[1]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ModelOpt prints progress and version warnings; the CLI keeps its output to one line."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _mtq() -> Any:
    try:
        with _quiet():
            import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise ConfigError(
            f"quantization needs nvidia-modelopt, which is not installed ({e})",
            "pip install 'ingot[quant]'",
        ) from None
    return mtq


def modelopt_version() -> str:
    import modelopt

    return f"nvidia-modelopt {modelopt.__version__}"


def load_hf_model(model_dir: Path, device: str, cfg: ModelConfig) -> tuple[Any, Any]:
    """(model, tokenizer) from safetensors only; fp32 on the CPU, the model dtype on a GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dtype = torch.float32 if device == "cpu" else getattr(torch, cfg.dtype)
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    finally:
        hf_logging.enable_progress_bar()
    return model.to(device).eval(), tokenizer


def token_windows(tokenizer: Any, text: str, count: int, length: int) -> list[torch.Tensor]:
    """Up to `count` consecutive, non-overlapping windows [1, <= length] of the text's tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + length] for i in range(0, len(ids), length)][:count]
    return [torch.tensor([w]) for w in windows if len(w) > 1]


def mtq_config(mtq: Any, opts: QuantOptions) -> dict[str, Any]:
    """ModelOpt's own preset for the mode (+ its FP8 KV-cache entries), group size checked."""
    if opts.mode == "fp8":
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    elif opts.mode == "int4_awq":
        cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
        _set_block_size(cfg["quant_cfg"], opts.group_size)
    else:  # KV cache only
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    if opts.lm_head:  # FP8 per tensor, as the layers; later entries override the preset's
        fp8 = {"num_bits": (4, 3), "axis": None}
        _add_entries(cfg, {"*lm_head.weight_quantizer": fp8, "*lm_head.input_quantizer": fp8})
    if opts.kv_cache_dtype == "fp8":
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        if isinstance(cfg["quant_cfg"], dict):  # older ModelOpt: a pattern -> config dict
            cfg["quant_cfg"].update(kv)
        else:
            cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(kv)
    return cfg


def _add_entries(cfg: dict[str, Any], entries: dict[str, Any]) -> None:
    """Pattern -> quantizer config entries, after the preset's (either ModelOpt format)."""
    if isinstance(cfg["quant_cfg"], dict):  # older ModelOpt: a pattern -> config dict
        cfg["quant_cfg"].update(entries)
    else:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [
            {"quantizer_name": k, "cfg": v} for k, v in entries.items()
        ]


def _set_block_size(quant_cfg: Any, group_size: int) -> None:
    entries = (
        quant_cfg.items()
        if isinstance(quant_cfg, dict)
        else ((e.get("quantizer_name"), e.get("cfg")) for e in quant_cfg)
    )
    for name, c in entries:
        if name == "*weight_quantizer" and isinstance(c, dict) and "block_sizes" in c:
            c["block_sizes"][-1] = group_size


def calibrate(
    model: Any, opts: QuantOptions, samples: list[torch.Tensor], progress: Progress
) -> None:
    """mtq.quantize(model) in place, one progress bar per pass over the samples (AWQ: two)."""
    mtq = _mtq()
    device = next(model.parameters()).device
    passes = iter(range(1, 100))

    def forward_loop(m: Any) -> None:
        desc = f"calibrating (pass {next(passes)})"
        for i, ids in enumerate(samples):
            progress(desc, i, len(samples))
            m(ids.to(device))
        progress(desc, len(samples), len(samples))

    with torch.no_grad(), _quiet():
        mtq.quantize(model, mtq_config(mtq, opts), forward_loop)
