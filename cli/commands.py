"""Registers every command module with the app."""

from __future__ import annotations

from ingot.cli.bench_cmd import bench_cmd
from ingot.cli.build_cmd import build_engine_cmd
from ingot.cli.convert_cmd import convert_checkpoint_cmd
from ingot.cli.inspect_cmd import inspect_engine_cmd
from ingot.cli.main import app, user_errors
from ingot.cli.run_cmd import run_engine_cmd

app.command("convert-checkpoint")(user_errors(convert_checkpoint_cmd))
app.command("build-engine")(user_errors(build_engine_cmd))
app.command("run-engine")(user_errors(run_engine_cmd))
app.command("inspect-engine")(user_errors(inspect_engine_cmd))
app.command("bench")(user_errors(bench_cmd))
