"""Checksums of rank files: the whole-file sha256 plus one sha256 per fixed-size chunk.

The whole-file digest is what `inspect-engine` shows and what a user can compare with
`sha256sum`; the chunk digests let a reader verify a 16 GB rank file on all cores at once
(hashlib releases the GIL), so checking an engine does not dominate its load time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK_BYTES = 1 << 28  # 256 MiB


class ChunkedSha256:
    """Feed bytes in order; get the whole-file digest and the per-chunk digests."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.whole = hashlib.sha256()
        self.chunks: list[str] = []
        self._chunk = hashlib.sha256()
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.whole.update(view)
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._chunk.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self.chunks.append(self._chunk.hexdigest())
                self._chunk, self._filled = hashlib.sha256(), 0

    def finish(self) -> tuple[str, list[str]]:
        """(whole-file sha256, chunk sha256s); the last chunk may be short."""
        if self._filled:
            self.chunks.append(self._chunk.hexdigest())
            self._chunk, self._filled = hashlib.sha256(), 0
        return self.whole.hexdigest(), list(self.chunks)


def sha256_file(path: Path, stop: threading.Event | None = None) -> str | None:
    """The whole file's sha256 (one pass, one core); None if `stop` was set meanwhile."""
    return _chunk_digest(path, 0, Path(path).stat().st_size, stop)


def _chunk_digest(
    path: Path, offset: int, size: int, stop: threading.Event | None = None
) -> str | None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while left:
            if stop is not None and stop.is_set():
                return None
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def chunks_match(
    path: Path, digests: list[str], chunk_bytes: int = CHUNK_BYTES, workers: int | None = None
) -> bool:
    """True when the file has exactly these chunk digests (checked in parallel)."""
    size = Path(path).stat().st_size
    if -(-size // chunk_bytes) != len(digests):
        return False
    workers = workers or min(len(digests), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ingot-sha") as pool:
        found = pool.map(
            lambda i: _chunk_digest(path, i * chunk_bytes, chunk_bytes), range(len(digests))
        )
        return all(a == b for a, b in zip(found, digests, strict=True))
