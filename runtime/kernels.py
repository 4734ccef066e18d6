"""Install an engine's ahead-of-time Triton kernels before the first launch, so nothing compiles.

The bundle (`kernels.bin`, checksummed like the rank files) holds each kernel's binary and
specialization; it is installed into a per-engine folder that Triton's cache then points at.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import EngineError

KERNELS_FILE = "kernels.bin"


def kernel_cache_dir(digest: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "ingot" / "kernels" / digest[:16]


def install_engine_kernels(engine_dir: Path, digest: str | None) -> int:
    """Install `engine_dir/kernels.bin` (sha256 `digest`) and point Triton at it; returns the
    number of kernels. EngineError when the bundle was built for another Triton or GPU."""
    path = Path(engine_dir) / KERNELS_FILE
    if digest is None or not path.is_file():
        return 0
    from ingot.plugins.aot import AOTBundleError, install_bundle, set_cache_dir

    dest = kernel_cache_dir(digest)
    # NOTE: the cache dir is set before anything launches, so Triton's own helper modules are
    # found (or built) there too.
    set_cache_dir(dest)
    try:
        return install_bundle(path.read_bytes(), dest).kernels
    except AOTBundleError as e:
        raise EngineError(e.message, e.hint) from None
