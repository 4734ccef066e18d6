"""The decoder's L2 weight prefetch: small decode steps read the start of each GEMV's weight
into L2 on a side stream while the kernels before that GEMV run (`ingot.plugins.l2_prefetch`).

A step of a few tokens is a chain of weight streams with small kernels between them (RoPE + KV
write and attention before the o projection, a norm before gate_up and before the next qkv);
DRAM idles through those. The side stream's prefetch kernel waits only for the GEMV before it,
so it overlaps the small kernels, and the main stream never waits for it until the end of the
forward pass (`join`). Works the same eagerly and inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from ingot.plugins.l2_prefetch import l2_prefetch, prefetchable

MAX_TOKENS = 8  # steps up to this many tokens run GEMVs (weight streams); larger ones are GEMMs
DEFAULT_BYTES = 16 * 1024**2  # per GEMV; the H200's L2 holds 50 MB


class WeightPrefetch:
    """`issue(w)` after launching the GEMV before w's; `join()` at the end of the forward pass.
    device "meta": the launches are made (the builder's dry run records them), no streams."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._forked = False

    def issue(self, w: torch.Tensor) -> None:
        if not prefetchable(w):
            return
        if self.side is None:
            l2_prefetch(w, self.max_bytes)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            l2_prefetch(w, self.max_bytes)
        self._forked = True

    def join(self) -> None:
        """The main stream waits for the prefetch launches (not for the data: a prefetch
        has no completion); graph capture needs the side stream joined back."""
        if self._forked:
            torch.cuda.current_stream().wait_stream(self.side)
            self._forked = False
