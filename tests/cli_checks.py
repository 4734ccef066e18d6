"""Helpers the CLI tests share: invoke `ingot`, and check the one-line user-error contract."""

from __future__ import annotations

from typer.testing import CliRunner

from ingot.cli.main import app


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line_error(r, *needles: str) -> None:
    """Exit code 2, exactly one stderr line starting with 'error: ', no traceback, each needle."""
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, r.stderr
    assert err[0].startswith("error: ") and "Traceback" not in r.output
    for n in needles:
        assert n in err[0], err[0]
