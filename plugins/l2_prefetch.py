"""Read the start of a weight into L2 ahead of the GEMV that streams it (SM 90+).

A batch-1 decode step is a chain of weight streams (the GEMVs) with small kernels between them
(RoPE + KV write, attention, norms: ~10-18 µs per layer on the H200) during which DRAM is nearly
idle. Weights never depend on the step's data, so while those kernels run, a kernel on a side
stream can issue `cp.async.bulk.prefetch.L2` for the next GEMV's first megabytes: the GEMV then
finds them in L2 and DRAM was busy the whole time. The prefetch is a hint (no data changes,
no completion to wait for): each lane of the kernel issues one bulk prefetch and the program
exits while the copy engine fetches.
"""

from __future__ import annotations

import torch

try:  # NOTE: CPU installs may lack Triton; there prefetching is a no-op anyway
    import triton
    import triton.language as tl
except ImportError:
    triton = None

LANES = 32  # bulk prefetches per program (one warp, one each)
MIN_LANE_BYTES = 16 * 1024  # smaller pieces only add instructions


def prefetchable(w: torch.Tensor) -> bool:
    """Tensors the kernel can read ahead: contiguous, 16-byte aligned, on a CUDA device (or
    `meta`: the builder's dry run records the launch for the ahead-of-time bundle)."""
    return (
        triton is not None
        and w.device.type in ("cuda", "meta")
        and w.is_contiguous()
        and w.data_ptr() % 16 == 0
    )


if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(ptr, lane_bytes, total_bytes, LANES: tl.constexpr):
        """Lane i of program p prefetches bytes [j * lane_bytes, ...) of ptr, j = p * LANES + i,
        clipped to total_bytes (all multiples of 16, as the instruction requires)."""
        j = tl.program_id(0) * LANES + tl.arange(0, LANES)
        start = j.to(tl.int64) * lane_bytes
        size = tl.minimum(total_bytes - start, lane_bytes).to(tl.int32)
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.b32 $0, 0;
            }""",
            constraints="=r,l,r",
            args=[ptr + start, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def l2_prefetch(w: torch.Tensor, max_bytes: int, programs: int = 64) -> None:
    """Issue L2 prefetches for the first min(max_bytes, w's size) bytes of `w` (`prefetchable`)."""
    total = min(max_bytes, w.numel() * w.element_size()) // 16 * 16
    if total <= 0:
        return
    lane = max(MIN_LANE_BYTES, triton.cdiv(triton.cdiv(total, programs * LANES), 16) * 16)
    grid = (triton.cdiv(triton.cdiv(total, lane), LANES),)
    _l2_prefetch_kernel[grid](w.view(-1).view(torch.uint8), lane, total, LANES=LANES, num_warps=1)
