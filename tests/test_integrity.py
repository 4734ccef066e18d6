"""Chunked checksums: the same whole-file digest as hashlib, and any altered byte is caught."""

from __future__ import annotations

import hashlib
import os

import pytest

from ingot.runtime.integrity import ChunkedSha256, chunks_match


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4567])
def test_chunks_and_whole_digest(tmp_path, size):
    data = os.urandom(size)
    h = ChunkedSha256(chunk_bytes=1000)
    for i in range(0, size, 37):  # odd write sizes straddle chunk boundaries
        h.update(data[i : i + 37])
    whole, chunks = h.finish()
    assert whole == hashlib.sha256(data).hexdigest()
    assert chunks == [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, size, 1000)]
    path = tmp_path / "f"
    path.write_bytes(data)
    assert chunks_match(path, chunks, chunk_bytes=1000, workers=3)
    if size:
        altered = bytearray(data)
        altered[size // 2] ^= 1
        path.write_bytes(bytes(altered))
        assert not chunks_match(path, chunks, chunk_bytes=1000)
    path.write_bytes(data + b"x")  # appended bytes change the chunk count or the last chunk
    assert not chunks_match(path, chunks, chunk_bytes=1000)
