"""The CLI's error contract outside any command's body: a bug raised while parsing options
(here `--version`'s callback) is one line, a crash report and exit code 1, like a bug inside
a command (tests/test_engine_cli.py::test_a_bug_in_a_build_is_one_line_and_a_crash_report)."""

from __future__ import annotations

import tempfile

from cli_checks import invoke

import ingot.cli.main as cli_main


class _UnprintableVersion:
    def __format__(self, spec: str) -> str:
        raise LookupError("version metadata is missing")


def test_a_bug_in_an_option_callback_is_one_line_and_a_crash_report(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_main, "INGOT_VERSION", _UnprintableVersion())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("INGOT_TRACEBACK", raising=False)
    r = invoke("--version")
    assert r.exit_code == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: internal error") and "Traceback" not in r.output
    assert "LookupError: version metadata is missing" in line
    (report,) = tmp_path.glob("ingot-crash-*.txt")
    assert str(report) in line and "_version_callback" in report.read_text()

    monkeypatch.setenv("INGOT_TRACEBACK", "1")
    r = invoke("--version")
    assert isinstance(r.exception, LookupError)
    assert len(list(tmp_path.glob("ingot-crash-*.txt"))) == 1


def test_version_still_prints():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"ingot {cli_main.INGOT_VERSION}"


def test_an_error_quoting_a_multi_line_message_is_still_one_line():
    from ingot.runtime.errors import EngineError

    e = EngineError(
        "cannot load the tokenizer: Couldn't instantiate:\n  (1) a file,\n", "rebuild\nit"
    )
    assert (
        e.one_line() == "cannot load the tokenizer: Couldn't instantiate: (1) a file, (rebuild it)"
    )
