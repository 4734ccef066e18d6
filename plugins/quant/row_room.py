"""Room for padded rows under the FP8 operands the quantizing kernels write.

cuBLASLt's FP8 GEMM picks its algorithm from the shape, and some row counts get a slow one: on
the H200 Llama-3.1-8B's gate_up took 101.9 us at 448 rows and 82.0 at 512 (docs/bench/
batch-gemms-fast-accum-h200-2026-12-06.json), on the H100 120.8 and 85.2. A GEMM whose
tactic says to pad (`pad_rows`, timed by a build on the GPU: compiler/fast_accum.py) runs on
the rows rounded up to PAD_ROWS_TO. The quantizing kernels (norm and SwiGLU) allocate their
output with those rows already there, so padding is a view, not a copy; the extra rows hold
whatever the memory held, and a GEMM's output row depends on its own input row only, so they
reach nothing but the output rows that are cut off again.
"""

from __future__ import annotations

import torch

# cuBLASLt's FP8 kernels tile the rows by 64-256; a multiple of 128 lands on the shapes timed
# faster (448 -> 512)
PAD_ROWS_TO = 128


def padded_rows(rows: int) -> int:
    return -(-rows // PAD_ROWS_TO) * PAD_ROWS_TO


def empty_rows(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized [rows, cols] tensor whose storage holds padded_rows(rows) rows."""
    return torch.empty((padded_rows(rows), cols), dtype=dtype, device=device)[:rows]


def with_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, K] as `rows` >= T rows, x's rows first: a view where x's storage has room past it
    (`empty_rows`), else a copy into a new tensor (the extra rows uninitialized either way)."""
    t, k = x.shape
    room = x.untyped_storage().nbytes() - x.storage_offset() * x.element_size()
    if x.is_contiguous() and room >= rows * k * x.element_size():
        return x.as_strided((rows, k), (k, 1))
    out = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    out[:t].copy_(x)
    return out


def row_ranges(rows: str) -> list[tuple[int, int | None]]:
    """ "512-1024,4097-" -> [(512, 1024), (4097, None)]: the row ranges of a tactic's
    `fast_accum_rows` or `pad_rows`, inclusive (None: no upper bound)."""
    out = []
    for part in rows.split(","):
        lo, _, hi = part.partition("-")
        out.append((int(lo), int(hi) if hi else None))
    return out


def in_ranges(ranges: list[tuple[int, int | None]], rows: int) -> bool:
    return any(a <= rows and (b is None or rows <= b) for a, b in ranges)
