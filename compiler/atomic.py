"""Write an output directory atomically: a failed or interrupted command leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ingot.runtime.errors import ConfigError, OutputExistsError


def _is_nonempty(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _cannot_create(path: Path, e: OSError) -> ConfigError:
    return ConfigError(
        f"cannot create {path}: {e.strerror or e}", hint="choose a writable --output-dir"
    )


def check_writable_dir(path: Path) -> None:
    """ConfigError unless `path` is, or can be made, a dir a file can be written in; checked
    before slow work, and leaves no dir behind that was not there."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise _cannot_create(path, e) from None
    finally:
        for p in missing:  # deepest first
            if p.is_dir():
                p.rmdir()


def refuse_replacing_input(output_dir: Path, input_dir: Path, input_what: str) -> None:
    """ConfigError when --output-dir is the input dir or a dir above it: replacing it (with
    --force) would delete the input the command reads."""
    src, out = Path(input_dir).resolve(), Path(output_dir).resolve()
    if out == src or out in src.parents:
        raise ConfigError(
            f"--output-dir {output_dir} would replace the {input_what}",
            hint=f"choose an output dir outside the {input_what}",
        )


@contextmanager
def atomic_output_dir(path: Path, force: bool, what: str) -> Iterator[Path]:
    """Yield a temp dir next to `path`; on success rename it into place.

    Refuses (OutputExistsError) if `path` is a file, or a non-empty dir and not `force`. The old
    dir is replaced only after the new one is complete, so a failure never clobbers a good
    artifact. On any exception (KeyboardInterrupt included) the temp dir is removed.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(
            f"output path {path} exists and is not a directory", hint="choose another output path"
        )
    if _is_nonempty(path) and not force:
        raise OutputExistsError(
            f"{path} already holds {_article(what)} {what}; it was kept",
            hint="pass --force to replace it",
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: same parent dir -> same filesystem, so the final rename is atomic.
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    except OSError as e:
        raise _cannot_create(path, e) from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        _commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _commit(tmp: Path, path: Path) -> None:
    if not path.exists():
        tmp.rename(path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    old.rmdir()
    path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        old.rename(path)  # put the good artifact back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _article(noun: str) -> str:
    return "an" if noun[:1].lower() in "aeiou" else "a"
