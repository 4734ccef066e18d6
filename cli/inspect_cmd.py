"""`ingot inspect-engine`."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def inspect_engine_cmd(
    engine_dir: Path = typer.Argument(None, help="Engine dir to describe and verify."),
    engine_dir_opt: Path = typer.Option(
        None, "--engine-dir", help="The engine dir as an option, as run-engine takes it."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the engine config as JSON."),
) -> None:
    """Print an engine's metadata and verify the checksum of every rank file."""
    from ingot.runtime.engine import read_engine_config, verify_rank_files
    from ingot.runtime.engine_format import EngineFile
    from ingot.runtime.errors import ConfigError

    if (engine_dir is None) == (engine_dir_opt is None):
        raise ConfigError(
            "inspect-engine takes one engine dir",
            "give it as ENGINE_DIR or --engine-dir ENGINE_DIR",
        )
    engine_dir = engine_dir or engine_dir_opt

    cfg = read_engine_config(engine_dir)
    verify_rank_files(engine_dir, cfg, full=True)
    if as_json:
        typer.echo(json.dumps(cfg.to_dict(), indent=2))
        return
    m, b, q = cfg.model, cfg.build, cfg.quant
    typer.echo(f"engine        {engine_dir}")
    typer.echo(f"format        ingot-engine v{cfg.format_version} (ingot {cfg.ingot_version})")
    typer.echo(f"target        {cfg.target}   tp_size {cfg.tp_size}")
    typer.echo(
        f"model         {m.architecture} ({m.family}) {m.num_layers} layers, hidden {m.hidden_size}, "
        f"heads {m.num_heads}/{m.num_kv_heads}, vocab {m.vocab_size}, {m.dtype}"
    )
    typer.echo(f"quantization  {q.mode} (kv cache {q.kv_cache_dtype})" + _quant_detail(q))
    rep = (cfg.extra or {}).get("quant_report")
    if rep:
        base = rep.get("unquantized_baseline", {})
        typer.echo(
            f"accuracy      top-1 agreement {rep['top1_agreement']:.4f}, mean KL "
            f"{rep['mean_kl']:.4g} (max {rep['max_kl']:.4g}) nats on "
            f"{rep['held_out']['positions']} held-out tokens; unquantized {m.dtype}: "
            f"top-1 {base.get('top1_agreement', float('nan')):.4f}, "
            f"KL {base.get('mean_kl', float('nan')):.4g}"
        )
        typer.echo(
            f"              vs {rep['reference']}; calibrated on "
            f"{rep['calibration']['samples']} sequences with {rep['calibration']['tool']}"
        )
    typer.echo(
        f"build         max_batch_size {b.max_batch_size}, max_seq_len {b.max_seq_len}, "
        f"max_num_tokens {b.max_num_tokens}, tokens_per_block {b.tokens_per_block}"
        + (", programmatic dependent launch" if b.pdl else "")
        + (", norms folded into the decode GEMVs" if b.fused_norms else "")
        + (", FP8 GEMMs with fast accumulation" if b.fp8_fast_accum else "")
    )
    phases = (cfg.extra or {}).get("build_seconds")
    if phases:  # engines built before it do not record them
        typer.echo(
            f"build time    {sum(phases.values()):.1f} s ("
            + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
            + ")"
        )
    typer.echo(f"plugins       {_tactics_origin(cfg)}")
    for p in cfg.plugins:
        label = f"{p.name}@{p.site}" if p.site else p.name
        timed = f"  ({min(p.timings_ms.values()):.4f} ms)" if p.timings_ms else ""
        if "unfused" in (p.timings_ms or {}) and not (p.params or {}).get("max_m"):
            # compiler/tactic_select.unfused_if_faster: the decoder runs the two kernels
            timed += "  unfused: the activation kernel, then the GEMM at mlp.down"
        typer.echo(f"  {label:<22} v{p.version}  tactic {p.tactic or '-'}{timed}")
    extra = cfg.extra or {}
    for name, digest in cfg.rank_files.items():
        size = (engine_dir / name).stat().st_size
        if name.endswith(".engine"):
            what = f"{len(EngineFile(engine_dir / name).tensor_names())} tensors"
        else:
            what = f"{extra.get('kernels', '?')} kernels, Triton {extra.get('triton_version', '?')}"
        typer.echo(f"{name:<14}{size / 2**20:.1f} MiB, {what}, sha256 {digest[:16]}… verified")


def _tactics_origin(cfg) -> str:
    """Where the engine's tactics come from: the GPU that timed them, or the default table."""
    from ingot.runtime.engine import TACTICS_TIMED_ON

    timed_on = (cfg.extra or {}).get(TACTICS_TIMED_ON)
    if timed_on:
        return f"tactics timed on {timed_on}"
    if any(p.timings_ms for p in cfg.plugins):  # built before the GPU's name was recorded
        return "tactics timed on the target GPU"
    return "tactics from the default table (not timed on a GPU)"


def _quant_detail(q) -> str:
    lm_head = ", lm_head FP8 too" if q.lm_head else ""
    if q.mode == "fp8":
        return ", W8A8 FP8 e4m3, static per-tensor scales" + lm_head
    if q.mode == "int4_awq":
        return f", W4A16 INT4 AWQ, group size {q.group_size}" + lm_head
    return ""
