"""Tactic timing on the build GPU: the builder times each candidate and keeps the fastest."""

from __future__ import annotations

import functools
import statistics
import warnings
from collections.abc import Callable
from typing import Any

from .compile_threads import map_in_threads
from .registry import Tactic, get_spec, import_attr

InputsFn = Callable[[], "tuple[tuple[Any, ...], dict[str, Any]]"]


def resolve_factory(spec_name: str) -> Callable[[Tactic | None], Callable[..., Any]]:
    """The registry's "cuda" factory of `spec_name`."""
    return import_attr(get_spec(spec_name).impls["cuda"])


def _median_ms_events(fn: Callable[[], Any], repeats: int, flush: Any) -> float:
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _median_ms_graph(
    fn: Callable[[], Any], repeats: int, flush: Any, before: Callable[[], Any], calls: int = 10
) -> float:
    """(graph of `calls` x [flush, before, fn]) minus (graph of `calls` x [flush, before]), per
    call: device time as a captured decode step sees it, without host launch latency."""
    import torch

    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(calls):
                    flush.zero_()
                    before()
                    if with_fn:
                        fn()
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    samples = {0: [], 1: []}
    for _ in range(repeats):
        for i, g in enumerate(graphs):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            samples[i].append(s.elapsed_time(e))
    diff = statistics.median(samples[0]) - statistics.median(samples[1])
    return max(diff, 0.0) / calls


def _nothing() -> None:
    return None


def _median_ms(
    fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None
) -> float:
    import torch

    # NOTE: flush L2 between calls so a kernel is timed on cold data, the way it runs inside a
    # model step. Graph replay keeps host launch latency out (decode runs as CUDA graphs); a fn
    # that cannot be captured (host syncs) is timed with events around each call instead.
    flush = torch.empty(128 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    before = before or _nothing
    for _ in range(3):
        before()
        fn()
    torch.cuda.synchronize()
    try:
        return _median_ms_graph(fn, max(5, repeats // 5), flush, before)
    except Exception:  # noqa: BLE001 - not capturable: fall back to per-call events
        torch.cuda.synchronize()
        return _median_ms_events(fn, repeats, flush)


def _first_calls(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call once, side by side in threads: Triton compiles a kernel at its first call, so
    the candidates compile in parallel rather than each as it is timed (the build's tactic
    phase). Their results (None where a call failed); errors are left for the timing, which
    reports them per candidate."""
    import torch

    def first(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception:  # noqa: BLE001 - timed (and reported as inf) after
            return None

    if torch.cuda.is_available():  # Triton's driver set up once here, not by racing threads
        from triton.runtime.driver import driver

        driver.active.get_current_device()
    outputs = map_in_threads(first, calls)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return outputs


def relative_error(out: Any, want: Any) -> float:
    """||out - want|| / ||want|| in float64 (inf for a shape mismatch or a non-finite value)."""
    import torch

    if not isinstance(out, torch.Tensor) or out.shape != want.shape:
        return float("inf")
    out, want = out.double(), want.double()
    err = ((out - want).norm() / want.norm().clamp_min(1e-30)).item()
    return err if err == err else float("inf")  # NaN -> inf


def _reference_output(spec_name: str, reference, args, kwargs) -> Any:
    """The reference op's output for the candidates' check; None (no check, with a warning)
    when there is none or it cannot run on these inputs: the check guards the build, it does
    not stop it."""
    if reference is None:
        return None
    try:
        return reference(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported, the timing goes on unchecked
        warnings.warn(f"{spec_name}: candidates not checked, the reference failed: {e}",
                      stacklevel=3)  # fmt: skip
        return None


def _in_pdl_scope(fn: Callable[[], Any]) -> Callable[[], Any]:
    from .pdl import scope

    def call() -> Any:
        with scope(True):
            return fn()

    return call


def time_tactics(
    spec_name: str,
    candidates: tuple[Tactic, ...] | list[Tactic],
    make_inputs: InputsFn,
    repeats: int = 50,
    factory: Callable[[Tactic | None], Callable[..., Any]] | None = None,
    before: Callable[[], Any] | None = None,
    reference: Callable[..., Any] | None = None,
    tolerance: float = 1e-2,
    pdl: bool = False,
) -> list[tuple[Tactic, float]]:
    """Median milliseconds per call of each candidate, fastest first.

    make_inputs() -> (args, kwargs) for one call; it is called once and shared by every
    candidate. A candidate that fails to compile or launch (e.g. out of shared memory) is
    reported with float('inf') rather than aborting the build. `factory` overrides the lookup
    of the plugin's cuda factory (used to time a sub-kernel, e.g. decode attention alone).

    before: the call a PDL engine's decode step makes just ahead of this one (e.g. the norm
    before a GEMV). Then both run with programmatic dependent launch and each candidate is
    charged what it adds to `before` alone, so a GEMV whose programs load their weights while
    `before` runs gets that credit (plugins/pdl.py).

    pdl: the candidates run their PDL variants even with no `before`, as a PDL engine's decode
    step runs them: a GEMV variant's weight chunks loaded before its wait hold registers, so
    it may fit fewer programs an SM than its plain variant and its grid take another wave.
    (An FP8 engine's SwiGLU GEMV picked without PDL, n8 with two such chunks, needs 160
    registers against 128, 3 programs an SM against 4, two waves for its 512 programs; with
    one chunk in every GEMV that engine decoded 8% faster on the H100, docs/performance.md.)

    reference: the op's plain-torch implementation, run once on the same inputs; a candidate
    whose first output is further than `tolerance` from it (relative error) computed the wrong
    thing on this GPU: it is reported as inf with a warning and never chosen, so a fast but
    wrong kernel cannot end up in an engine.
    """
    factory = factory or resolve_factory(spec_name)
    args, kwargs = make_inputs()
    results: list[tuple[Tactic, float]] = []
    error: Exception | None = None
    if before is not None:
        before = _in_pdl_scope(before)
    calls = []
    for tactic in candidates:
        call = functools.partial(factory(tactic), *args, **kwargs)
        calls.append(_in_pdl_scope(call) if before or pdl else call)
    outputs = _first_calls(calls)
    want = _reference_output(spec_name, reference, args, kwargs)
    wrong = []
    for tactic, call, out in zip(candidates, calls, outputs, strict=True):
        if want is not None and out is not None:
            err = relative_error(out, want)
            if not err <= tolerance:
                wrong.append(f"{tactic.name} ({err:.3g})")
                results.append((tactic, float("inf")))
                continue
        try:
            ms = _median_ms(call, repeats, before)
        except Exception as e:  # noqa: BLE001 - a failing tactic is skipped, not fatal
            ms, error = float("inf"), e
        results.append((tactic, ms))
    if wrong:
        warnings.warn(f"{spec_name}: not used, output off the reference on this GPU (relative "
                      f"error): {', '.join(wrong)}", stacklevel=2)  # fmt: skip
    if all(ms == float("inf") for _, ms in results) and (error is not None or wrong):
        # every candidate failing is a bug in the inputs or the plugin, not a tactic's limit
        why = f"{error}" if error is not None else f"wrong output: {', '.join(wrong)}"
        raise RuntimeError(f"no {spec_name} tactic ran: {why}") from error
    return sorted(results, key=lambda r: r[1])
