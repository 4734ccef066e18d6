"""Text files named on the command line: every way they go wrong is one ConfigError line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingot.runtime.errors import ConfigError
from ingot.runtime.user_files import read_user_text


def test_reads_utf8_whatever_the_locale(tmp_path, monkeypatch):
    monkeypatch.setenv("LC_ALL", "C")
    path = tmp_path / "t.txt"
    path.write_bytes("naïve café\n".encode())
    assert read_user_text(path, "--x", "hint") == "naïve café\n"


@pytest.mark.parametrize(
    "kind, why",
    [
        ("missing", "--x {p} does not exist"),
        ("dir", "--x {p} is a directory, not a file"),
        ("latin1", "--x {p} is not UTF-8 text (byte 0xe9 at offset 3)"),
        ("unreadable", "cannot read --x {p}: Permission denied"),
    ],
)
def test_each_bad_file_is_one_config_error(tmp_path, monkeypatch, kind, why):
    path = tmp_path / "t.txt"
    if kind == "dir":
        path.mkdir()
    if kind == "latin1":
        path.write_bytes("caf\xe9".encode("latin-1") + b"\n")
    if kind == "unreadable":  # a mode bit would not stop root (CI), so the read fails as such
        path.write_text("x")

        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError) as e:
        read_user_text(path, f"--x {path}", "pass a text file")
    assert e.value.one_line() == f"{why.format(p=path)} (pass a text file)"
