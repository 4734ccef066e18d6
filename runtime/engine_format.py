"""The rank file of an engine (`rank{N}.engine`): weights and kernel blobs in one mmap-able file.

Layout (little endian):
    magic     8 bytes  b"INGOTENG"
    version   u32      ENGINE_FORMAT_VERSION of the writer
    reserved  u32      0
    hlen      u64      length of the JSON header
    header    hlen bytes of UTF-8 JSON:
              {"tensors": {name: {"dtype", "shape", "offset", "nbytes"}},
               "blobs": {name: {"offset", "nbytes"}}}
    padding   to a multiple of ALIGN
    data      tensors and blobs at their offsets (relative to the data start), each ALIGN-aligned

Tensors are read back as zero-copy views of a copy-on-write memory map.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from .errors import EngineError
from .integrity import ChunkedSha256
from .version import ENGINE_FORMAT_VERSION

MAGIC = b"INGOTENG"
ALIGN = 64
_PREAMBLE = struct.Struct("<8sIIQ")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _HashingWriter:
    """File writer that hashes what it writes, so the checksum costs no second pass."""

    def __init__(self, f) -> None:
        self.f, self.h, self.pos = f, ChunkedSha256(), 0

    def write(self, data) -> None:
        self.f.write(data)
        self.h.update(data)
        self.pos += len(memoryview(data).cast("B"))

    def pad_to(self, offset: int) -> None:
        if offset > self.pos:
            self.write(b"\0" * (offset - self.pos))


def write_engine_file(
    path: Path,
    tensors: dict[str, torch.Tensor],
    blobs: dict[str, bytes] | None = None,
    chunk_digests: list[str] | None = None,
) -> str:
    """Write `tensors` (any device; copied to CPU) and raw `blobs` to `path`; return the
    file's sha256. `chunk_digests`, if given, receives the per-chunk sha256s (integrity.py)."""
    blobs = blobs or {}
    index: dict[str, dict] = {"tensors": {}, "blobs": {}}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be stored in an engine")
        nbytes = t.numel() * t.element_size()
        index["tensors"][name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "offset": offset,
            "nbytes": nbytes,
        }
        offset = _aligned(offset + nbytes)
    for name, b in blobs.items():
        index["blobs"][name] = {"offset": offset, "nbytes": len(b)}
        offset = _aligned(offset + len(b))
    header = json.dumps(index, separators=(",", ":")).encode()
    data_start = _aligned(_PREAMBLE.size + len(header))
    with open(path, "wb") as raw_file:
        f = _HashingWriter(raw_file)
        f.write(_PREAMBLE.pack(MAGIC, ENGINE_FORMAT_VERSION, 0, len(header)))
        f.write(header)
        f.pad_to(data_start)
        for name, t in tensors.items():
            f.pad_to(data_start + index["tensors"][name]["offset"])
            flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            if flat.numel():
                f.write(memoryview(flat.numpy()))
        for name, b in blobs.items():
            f.pad_to(data_start + index["blobs"][name]["offset"])
            f.write(b)
        f.pad_to(data_start + offset)
    whole, chunks = f.h.finish()
    if chunk_digests is not None:
        chunk_digests[:] = chunks
    return whole


class EngineFile:
    """A read-only view of one rank file. Tensors share memory with the map (no copy)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise EngineError(
                f"cannot read {self.path}: {e}", "rebuild with `ingot build-engine`"
            ) from None
        size = len(self._mm)
        if size < _PREAMBLE.size:
            raise EngineError(f"{self.path.name} is truncated", "rebuild with `ingot build-engine`")
        magic, version, _, hlen = _PREAMBLE.unpack_from(self._mm, 0)
        if magic != MAGIC:
            raise EngineError(
                f"{self.path.name} is not an ingot engine file (bad magic)",
                "rebuild with `ingot build-engine`",
            )
        if version > ENGINE_FORMAT_VERSION:
            raise EngineError(
                f"{self.path.name} has engine format version {version}; this ingot reads up to "
                f"{ENGINE_FORMAT_VERSION}",
                "upgrade ingot or rebuild with this ingot's build-engine",
            )
        try:
            self._index = json.loads(self._mm[_PREAMBLE.size : _PREAMBLE.size + hlen])
        except ValueError:
            raise EngineError(
                f"{self.path.name} has a corrupt header", "rebuild with `ingot build-engine`"
            ) from None
        self._data = _aligned(_PREAMBLE.size + hlen)
        for name, meta in {**self._index["tensors"], **self._index["blobs"]}.items():
            if self._data + meta["offset"] + meta["nbytes"] > size:
                raise EngineError(
                    f"{self.path.name} is truncated (tensor {name})",
                    "rebuild with `ingot build-engine`",
                )

    def tensor_names(self) -> list[str]:
        return list(self._index["tensors"])

    def blob_names(self) -> list[str]:
        return list(self._index["blobs"])

    def tensor(self, name: str) -> torch.Tensor:
        meta = self._index["tensors"][name]
        dtype = _DTYPES[meta["dtype"]]
        count = meta["nbytes"] // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            return torch.empty(meta["shape"], dtype=dtype)
        flat = torch.frombuffer(
            self._mm, dtype=dtype, count=count, offset=self._data + meta["offset"]
        )
        return flat.view(meta["shape"])

    def blob(self, name: str) -> bytes:
        meta = self._index["blobs"][name]
        start = self._data + meta["offset"]
        return bytes(self._mm[start : start + meta["nbytes"]])
