"""A mixed step's decode attention beside its prefill attention, on a second CUDA stream.

A mixed step (prompt chunks and decoding sequences, run eagerly) launches the prefill kernel
over its prompt rows and the decode kernel over its trailing one-query rows. They write
disjoint rows of the output and read disjoint cache blocks, and they stress different units:
the prefill tiles the tensor cores, the decodes (one query over a whole context each) the
memory bus. One after the other on one stream, the decodes wait for the last prefill tile.
With `INGOT_OVERLAP_DECODES=1` the decode kernel goes first, on a side stream that waits for
everything queued before it, and the step's stream waits for it after the prefill kernel:
the GPU may run the two at once. Off by default until measured (scripts/bench_quant.sh
TPUT_AB_ENV). Never inside a graph capture: captured steps keep their one stream.
"""

from __future__ import annotations

import os

import torch

ENV = "INGOT_OVERLAP_DECODES"

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def overlap_decodes(q: torch.Tensor) -> bool:
    """Whether this launch of a mixed step's attention runs its decodes on the side stream."""
    return (
        q.is_cuda
        and os.environ.get(ENV, "0") == "1"
        and not torch.cuda.is_current_stream_capturing()
    )


class Beside:
    """`with beside:` launches on the device's side stream, after the current stream's queued
    work; `beside.join()` makes the current stream wait for them. A no-op when off."""

    def __init__(self, q: torch.Tensor, on: bool) -> None:
        self.on = on
        if on:
            self.main = torch.cuda.current_stream(q.device)
            side = _SIDE.get(q.device)
            if side is None:
                side = _SIDE[q.device] = torch.cuda.Stream(q.device)
            self.side = side
            self._ctx = torch.cuda.stream(side)

    def __enter__(self) -> Beside:
        if self.on:
            self.side.wait_stream(self.main)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            self._ctx.__exit__(*exc)

    def join(self) -> None:
        # NOTE: tensors the side stream used were made on the step's stream and outlive this
        # call; once the step's stream waits here, their reuse is ordered after the decodes
        if self.on:
            self.main.wait_stream(self.side)
