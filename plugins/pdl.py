"""Programmatic dependent launch (SM 90+) for the chain of small kernels in a decode step.

Without it, each kernel's programs are scheduled only after the kernel before it in the stream
has drained completely; a batch-1 decode step launches ~290 kernels, and the H200 profile shows
the gaps between them add up to a few percent of the step. With it, a kernel can be scheduled
while its predecessor finishes; each kernel first waits (`griddepcontrol.wait`) until the
predecessor has completed and its writes are visible, so results do not change. Engines built
with `--pdl` run their forward passes inside `scope(True)`; the kernels launched there are the
PDL variants, which the builder's dry run records for the ahead-of-time bundle.

A kernel taking part has a `PDL: tl.constexpr = False` parameter (off, or where it triggers:
AFTER_WAIT / BEFORE_WAIT) and calls `pdl_begin(PDL)` as its first statement, before any load,
store or early exit: a kernel that could finish without waiting would let its successor run
ahead of its own predecessor. The one exception is loads of tensors nothing writes during a
forward pass (weights, static scales): the GEMV loads its first weight chunks before the wait,
which is where PDL pays most. Kernels outside Triton (torch, cuBLAS) never signal early, so
their neighbours wait for them in full, as without PDL.

When a kernel lets the next one be scheduled (`TRIGGER`): "before_wait" (the default: as soon
as its programs start, so the next kernel's programs take the SM slots the running kernel no
longer needs and prefetch their weights during its tail and during latency-bound kernels such
as decode attention or a norm; H200, batch 1, in one process: +0.9-1.4% over "after_wait" in
three calls) or "after_wait" (after its own wait: at most two kernels of the chain are
resident at once). Both are safe for the same reason: a kernel completes only after its own
wait returned, i.e. after its predecessor completed, so a kernel past its wait sees every
earlier kernel of the chain completed and its writes visible. What may be read before the
wait: tensors nothing writes during a forward pass, and tensors written before the pass's
first PDL kernel by copies or kernels outside Triton (step inputs): a PDL kernel is launched
only once its predecessor started, so its code before the wait runs after every such earlier
operation completed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def active() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def scope(on: bool) -> Iterator[None]:
    """Kernels launched inside use programmatic dependent launch when `on`."""
    prev = active()
    _state.on = on
    try:
        yield
    finally:
        _state.on = prev


# the PDL constexpr of a participating kernel: 0 off, else where it triggers its successor
AFTER_WAIT, BEFORE_WAIT = 1, 2
_MODES = {"after_wait": AFTER_WAIT, "before_wait": BEFORE_WAIT}
TRIGGER = "before_wait"  # process-wide; scripts/bench_engine.py's A/B flips it


def launch_options() -> dict[str, int | bool]:
    """Extra launch arguments of a participating kernel: none outside a PDL scope (the plain
    variant, as before), else the PDL constexpr and Triton's `launch_pdl` option."""
    return {"PDL": _MODES[TRIGGER], "launch_pdl": True} if active() else {}


try:  # NOTE: CPU installs have no Triton; the runtime still calls scope()
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    import os

    # Triton's interpreter runs launches one after another (nothing to wait for) and has no
    # griddepcontrol: there the PDL variants run as they compute, which the CPU tests check.
    _INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
    _BEFORE_WAIT = tl.constexpr(BEFORE_WAIT)

    @triton.jit
    def pdl_begin(PDL: tl.constexpr):
        if PDL and not _INTERPRET:
            if PDL == _BEFORE_WAIT:
                tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be scheduled now
            tl.extra.cuda.gdc_wait()  # the previous kernel has finished; its writes are visible
            if PDL != _BEFORE_WAIT:
                tl.extra.cuda.gdc_launch_dependents()
