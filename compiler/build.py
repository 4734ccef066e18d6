"""build-engine: checkpoint dir -> engine dir for one target (cpu or an sm_XY GPU).

Steps: read and check the checkpoint; resolve the build config (defaults < preset < flags);
pick each plugin's implementation and tactic for the target; fold constants (RoPE tables);
write the rank file, config.json with checksums, and the tokenizer, all atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml

from ingot.plugins import get_spec, target_kind
from ingot.plugins.quant import GEMM_PLUGIN_OF_MODE, unused_plugins
from ingot.plugins.rope.reference import cos_sin_cache, inv_freq
from ingot.runtime.config import BuildConfig, ModelConfig, QuantConfig, pdl_capable
from ingot.runtime.distributed import local_model_config
from ingot.runtime.engine import (
    TACTICS_TIMED_ON,
    EngineConfig,
    PluginChoice,
    rank_file_name,
    write_engine_config,
)
from ingot.runtime.engine_format import write_engine_file
from ingot.runtime.errors import ConfigError, IngotWarning
from ingot.runtime.timing import Lap
from ingot.runtime.user_files import read_user_text

from . import fast_accum
from .atomic import atomic_output_dir, refuse_replacing_input
from .checkpoint import TOKENIZER_DIR, load_checkpoint, verify_rank_file
from .kernel_bundle import build_kernel_bundle
from .quantize.layout import repack_for_engine
from .tactic_select import can_time_on, default_choices, timed_choices

Progress = Callable[[str, int, int], None]
PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def find_preset(name_or_path: str) -> Path:
    """A preset is a YAML path, or the name of one shipped in ingot's configs/."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for cand in (PRESET_DIR / name_or_path, PRESET_DIR / f"{name_or_path}.yaml"):
        if cand.is_file():
            return cand
    known = sorted(x.stem for x in PRESET_DIR.glob("*.yaml"))
    raise ConfigError(f"preset {name_or_path!r} not found", f"use a YAML path or one of {known}")


def resolve_build_config(
    preset: str | None,
    overrides: dict[str, Any],
    model: ModelConfig | None = None,
    quant: QuantConfig | None = None,
) -> BuildConfig:
    """defaults < preset YAML < explicit flags (None in `overrides` means 'not given').

    A max_seq_len left at its default is capped at the model's max_position_embeddings; pdl
    left unset is on for an sm_90+ target when the engine's weights are unquantized.
    """
    fields = {f.name for f in dataclasses.fields(BuildConfig)}
    values: dict[str, Any] = {}
    if model is not None:
        default = BuildConfig().max_seq_len
        values["max_seq_len"] = min(default, model.max_position_embeddings)
    if preset:
        path = find_preset(preset)
        text = read_user_text(path, f"preset {path}", "pass a YAML file of build settings")
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"preset {path} is not valid YAML: {e}") from None
        build = data.get("build", data) if isinstance(data, dict) else None
        if not isinstance(build, dict):
            raise ConfigError(f"preset {path} must be a mapping of build settings")
        unknown = sorted(set(build) - fields)
        if unknown:
            raise ConfigError(
                f"preset {path} has unknown keys {unknown}", f"known: {sorted(fields)}"
            )
        values.update(build)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "pdl" not in values:  # neither preset nor flag
        # on for engines with unquantized or FP8 weights (any KV cache): an FP8 engine (FP8
        # lm_head) decoded 329.8 tok/s at batch 1 with it against 308.6 without in one process
        # once its GEMVs were timed as their PDL variants (H100, docs/performance.md
        # 2026-12-05 evening; before that fix PDL lost on FP8). Opt-in for INT4: its engine
        # was measured only with it
        pdl_default = quant is None or quant.mode in ("none", "fp8")
        values["pdl"] = pdl_default and pdl_capable(values.get("target", BuildConfig().target))
    return BuildConfig(**values)


# GPU archs whose kernels this Triton (3.6) compiles, checked by cross-building a tiny engine
# for each (sm_88 and sm_110 fail in ptxas; an unknown arch aborts inside LLVM, leaving the
# build's temp dir behind). Older than Ampere lacks the bf16 tensor cores the kernels use.
GPU_ARCHS = (80, 86, 87, 89, 90, 100, 101, 103, 120, 121)


def resolve_target(target: str) -> str:
    """'auto' -> this machine's GPU as 'sm_XY' if there is one, else 'cpu'. ConfigError for a
    GPU arch ingot cannot build for."""
    where = "--target"
    if target == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        major, minor = torch.cuda.get_device_capability()
        target, where = f"sm_{major}{minor}", "this machine's GPU"
    if target == "cpu":
        return target
    if not (target.startswith("sm_") and target[3:].isdigit()):
        raise ConfigError(f"unknown target {target!r}", "use cpu, auto, or a GPU arch like sm_90")
    arch = int(target[3:])
    if arch not in GPU_ARCHS:
        known = ", ".join(f"sm_{a}" for a in GPU_ARCHS)
        why = "older than Ampere (sm_80)" if 50 <= arch < 80 else "not a GPU arch it knows"
        raise ConfigError(
            f"ingot cannot build engines for {where} {target}: {why}",
            f"use one of {known}, or cpu",
        )
    return target


def select_plugins(
    target: str,
    model: ModelConfig,
    build: BuildConfig,
    progress: Progress | None = None,
    tactics: str = "auto",
    quant: QuantConfig | None = None,
) -> tuple[PluginChoice, ...]:
    """Each op's implementation and tactic for the target: timed on the target GPU when this
    machine has it and `tactics` is "auto", else the default tactic table (cross-build).
    Quantized GEMM plugins that the engine's quantization mode does not run are left out."""
    if tactics not in ("auto", "default"):
        raise ConfigError(f"unknown --tactics {tactics!r}", "use auto or default")
    quant = quant or QuantConfig()
    check_quant_target(target, quant)
    unused = unused_plugins(quant.mode, quant.lm_head)
    # NOTE: plugins without an implementation for the target kind are left out; an engine
    # that needs one fails when the kernel dry run binds its ops (`kernel_bundle`).
    timed = tactics == "auto" and can_time_on(target)
    if timed:
        choices = list(
            timed_choices(
                model,
                build,
                progress,
                frozenset(unused),
                quant.group_size,
                quant.lm_head,
                kv_fp8=quant.kv_cache_dtype == "fp8",
            )
        )
    else:
        choices = [c for c in default_choices(target, model) if c.name not in unused]
    # cuBLASLt's FP8 GEMMs timed on this GPU where the other tactics were (padded rows, and
    # fast accumulation with the flag), else the flag's fixed floor
    if not timed and not build.fp8_fast_accum:
        return tuple(choices)
    time_fn = fast_accum.gpu_time_fn() if timed else None
    return tuple(
        fast_accum.with_cublaslt_choices(
            choices, model, build, time_fn, progress, fast_accum=build.fp8_fast_accum
        )
    )


def check_fp8_fast_accum(build: BuildConfig, quant: QuantConfig) -> None:
    if build.fp8_fast_accum and quant.mode != "fp8" and not quant.lm_head:
        raise ConfigError(
            f"--fp8-fast-accum applies to FP8 GEMMs; this checkpoint ({quant.mode}) has none",
            "convert with --quant fp8 (or --quant-lm-head), or build without --fp8-fast-accum",
        )


def check_quant_target(target: str, quant: QuantConfig) -> None:
    """Refuse quantized engines for a target their kernels cannot run on (one clear line).

    FP8 (W8A8 weights or the KV cache) needs float8 tensor cores and conversions: SM >= 89.
    """
    kind = target_kind(target)
    gemm = GEMM_PLUGIN_OF_MODE.get(quant.mode)
    if gemm and kind not in get_spec(gemm).impls:
        raise ConfigError(
            f"target {target} is not supported yet for {quant.mode} engines "
            f"(plugin {gemm} has no {kind} implementation)",
            "build with --target cpu",
        )
    uses_fp8 = quant.mode == "fp8" or quant.kv_cache_dtype == "fp8" or quant.lm_head
    if kind == "cpu" or not uses_fp8:
        return
    sm: int | None = None
    if target.startswith("sm_") and target[3:].isdigit():
        sm = int(target[3:])
    elif target == "auto" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        sm = major * 10 + minor
    if sm is not None and sm < 89:
        what = "FP8 weights" if quant.mode == "fp8" or quant.lm_head else "an FP8 KV cache"
        raise ConfigError(
            f"target {target} cannot run {what}: FP8 kernels need SM >= 89 (Ada, Hopper or newer)",
            "build for an sm_89+ GPU or --target cpu, or convert without FP8 "
            "(--quant int4_awq / --kv-cache-dtype auto)",
        )


def check_max_kl(report: dict[str, Any] | None, max_kl: float | None) -> None:
    """--max-kl: the checkpoint's accuracy report must exist and its mean KL be <= max_kl."""
    if max_kl is None:
        return
    if not report or "mean_kl" not in report:
        raise ConfigError(
            "--max-kl needs an accuracy report, and this checkpoint has none (not quantized)",
            "drop --max-kl, or convert with --quant fp8|int4_awq",
        )
    if report["mean_kl"] > max_kl:
        raise ConfigError(
            f"the checkpoint's mean KL divergence {report['mean_kl']:.4g} exceeds --max-kl "
            f"{max_kl:g} (top-1 agreement {report.get('top1_agreement', float('nan')):.3f})",
            "re-convert with another --quant mode or more calibration data, or raise --max-kl",
        )


def check_fits(model: ModelConfig, build: BuildConfig) -> None:
    # a sequence holds at least one prompt token and one generated token: an engine of
    # max_seq_len 1 built fine and then refused every prompt at run time
    if build.max_seq_len < 2:
        raise ConfigError(
            f"--max-seq-len {build.max_seq_len} leaves no room for a generated token",
            "use --max-seq-len 2 or more (prompt + output tokens per sequence)",
        )
    if build.max_seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"--max-seq-len {build.max_seq_len} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}",
            f"use --max-seq-len {model.max_position_embeddings} or less",
        )
    bs = build.tokens_per_block
    if bs & (bs - 1):
        raise ConfigError(f"--tokens-per-block must be a power of two, got {bs}")
    # a block holds one sequence's tokens: past the smallest power of two that holds a whole
    # sequence, every sequence's one block is partly empty and the pool holds fewer sequences
    fit = 1 << (build.max_seq_len - 1).bit_length()
    if bs > fit:
        warnings.warn(
            IngotWarning(
                f"--tokens-per-block {bs} is larger than a whole sequence (--max-seq-len "
                f"{build.max_seq_len}): each sequence's one block leaves at least "
                f"{bs - build.max_seq_len} tokens unused, so the KV cache holds fewer "
                f"sequences (--tokens-per-block {fit} holds a whole sequence too)"
            ),
            stacklevel=2,
        )


def rope_tables(model: ModelConfig, max_seq_len: int) -> dict[str, torch.Tensor]:
    r = model.rope
    freqs = inv_freq(
        model.head_dim,
        r.theta,
        r.kind,
        r.factor,
        r.low_freq_factor,
        r.high_freq_factor,
        r.original_max_position_embeddings,
    )
    cos, sin = cos_sin_cache(freqs, max_seq_len)
    return {"rope.cos": cos, "rope.sin": sin}


@contextlib.contextmanager
def kernel_cache(target: str) -> Iterator[str | None]:
    """Building on the target GPU: a fresh Triton cache for the build, so the launcher modules
    Triton builds while timing can ship with the engine's kernels (the runtime then builds
    nothing). Otherwise nothing changes."""
    if not can_time_on(target):
        yield None
        return
    from ingot.plugins.aot import use_cache_dir

    with tempfile.TemporaryDirectory(prefix="ingot-triton-") as d, use_cache_dir(d):
        yield d


def write_kernels(
    out: Path,
    model: ModelConfig,
    quant,
    build: BuildConfig,
    plugins: tuple[PluginChoice, ...],
    weights: dict[str, torch.Tensor],
    rank_files: dict[str, str],
    progress: Progress | None,
    host_stubs_from: str | None = None,
) -> dict[str, Any]:
    """Compile every Triton kernel the engine launches for its SM into kernels.bin."""
    import triton

    from ingot.runtime.kernels import KERNELS_FILE

    if progress:
        progress("compiling kernels", 0, 1)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    blob, count = build_kernel_bundle(model, quant, build, plugins, shapes, host_stubs_from)
    (out / KERNELS_FILE).write_bytes(blob)
    rank_files[KERNELS_FILE] = sha256_bytes(blob)
    if progress:
        progress("compiling kernels", 1, 1)
    return {"triton_version": triton.__version__, "kernels": count}


@contextlib.contextmanager
def _verifying(ckpt_dir: Path) -> Iterator[Callable[[], None]]:
    """The checkpoint's sha256 checked in a thread beside the build's other work (hashing runs
    outside the GIL; 16 s of a 16 GB build's critical path otherwise); yields the wait, which
    raises CheckpointError on a mismatch, before the engine is committed. Leaving early (an
    error) stops the hashing."""
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingot-verify") as pool:
        check = pool.submit(verify_rank_file, ckpt_dir, 0, stop)
        try:
            yield check.result
        finally:
            stop.set()


def build_engine(
    checkpoint_dir: Path,
    output_dir: Path,
    *,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
    target: str = "cpu",
    force: bool = False,
    progress: Progress | None = None,
    tactics: str = "auto",
    max_kl: float | None = None,
) -> Path:
    """Build an engine; returns its dir. Raises IngotError subclasses on bad input.

    max_kl: refuse (ConfigError) when the checkpoint's accuracy report has a mean KL above it.
    """
    # NOTE: the output check comes first so a kept artifact is reported before any slow work.
    phases: dict[str, float] = {}  # seconds per phase, kept in the engine (extra.build_seconds)
    laps = Lap(phases, torch.device("cpu"))
    refuse_replacing_input(Path(output_dir), Path(checkpoint_dir), "checkpoint dir")
    with (
        atomic_output_dir(Path(output_dir), force, "engine") as tmp,
        _verifying(Path(checkpoint_dir)) as verified,
    ):
        meta, tensors = load_checkpoint(Path(checkpoint_dir), verify_hash=False)
        model: ModelConfig = meta["model"]
        report = meta.get("quant_report")
        check_max_kl(report, max_kl)
        overrides = dict(overrides or {})
        overrides["target"] = resolve_target(target)
        build = resolve_build_config(preset, overrides, model, meta["quant"])
        check_fits(model, build)
        check_quant_target(build.target, meta["quant"])
        check_fp8_fast_accum(build, meta["quant"])
        tp = meta["tp_size"]
        if tp > 1 and (meta["quant"].mode != "none" or meta["quant"].kv_cache_dtype != "auto"):
            raise ConfigError(
                f"tp_size {tp} is not supported yet for quantized engines",
                "convert the checkpoint with --tp-size 1",
            )
        names = list(tensors)
        laps("checkpoint")
        weights = _engine_weights(meta, tensors, build, progress)
        laps("weights")
        # Tactics and ahead-of-time kernels are sized for one rank's shapes (tp 1: the model).
        shapes_model = local_model_config(model, tp)
        rank_files: dict[str, str] = {}
        rank_chunks: dict[str, list[str]] = {}
        extra = {"torch_version": torch.__version__, "source": meta.get("source", {})}
        if report:
            extra["quant_report"] = report
        # NOTE: the rank files are written (disk and hashing, both outside the GIL) while the
        # main thread times tactics and compiles kernels; the two overlap fully. Ranks > 0 are
        # read, packed and written one after another by the writer thread.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingot-write") as pool:
            writing = [pool.submit(_write_file, tmp / rank_file_name(0), weights)]
            writing += [
                pool.submit(_write_rank, Path(checkpoint_dir), r, tmp, build) for r in range(1, tp)
            ]
            try:
                with kernel_cache(build.target) as cache_dir:
                    plugins = select_plugins(
                        build.target, shapes_model, build, progress, tactics, meta["quant"]
                    )
                    laps("tactics")
                    if tactics == "auto" and can_time_on(build.target):
                        extra[TACTICS_TIMED_ON] = torch.cuda.get_device_name()
                    if target_kind(build.target) == "cuda":
                        extra.update(
                            write_kernels(
                                tmp,
                                shapes_model,
                                meta["quant"],
                                build,
                                plugins,
                                weights,
                                rank_files,
                                progress,
                                cache_dir,
                            )
                        )
                    laps("kernels")
            finally:
                for r, future in enumerate(writing):
                    name = rank_file_name(r)
                    rank_files[name], rank_chunks[name] = future.result()
        laps("rank_files_wait")  # their writing overlaps the tactics and kernels
        if progress:
            progress("writing engine", len(names), len(names))
        src_tok = Path(checkpoint_dir) / TOKENIZER_DIR
        if src_tok.is_dir():
            shutil.copytree(src_tok, tmp / TOKENIZER_DIR)
        laps("tokenizer")
        verified()  # raises CheckpointError on a mismatch
        laps("checkpoint_verify_wait")
        extra["build_seconds"] = {k: round(v, 3) for k, v in phases.items()}
        cfg = EngineConfig(
            model=model,
            quant=meta["quant"],
            build=build,
            plugins=plugins,
            rank_files=dict(sorted(rank_files.items())),
            rank_chunks=rank_chunks,
            tp_size=tp,
            extra=extra,
        )
        write_engine_config(tmp, cfg)
    return Path(output_dir)


def _engine_weights(
    meta: dict[str, Any], tensors, build: BuildConfig, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """One rank's engine tensors: checkpoint tensors in their kernels' layout + RoPE tables."""
    names = list(tensors)
    weights: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        # Quantized weights move into the layout their kernels read (quantize/layout.py).
        weights[name] = repack_for_engine(meta["quant"], name, tensors[name])
        if progress:
            progress("packing weights", i + 1, len(names))
    weights.update(rope_tables(meta["model"], build.max_seq_len))
    return weights


def _write_file(path: Path, weights: dict[str, torch.Tensor]) -> tuple[str, list[str]]:
    """Write one rank file; (whole-file sha256, per-chunk sha256s)."""
    chunks: list[str] = []
    return write_engine_file(path, weights, chunk_digests=chunks), chunks


def _write_rank(
    checkpoint_dir: Path, rank: int, out: Path, build: BuildConfig
) -> tuple[str, list[str]]:
    """tp: read, check and pack rank `rank`'s checkpoint file into its engine file."""
    meta, tensors = load_checkpoint(checkpoint_dir, rank=rank)
    return _write_file(out / rank_file_name(rank), _engine_weights(meta, tensors, build))
