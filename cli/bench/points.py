"""What each mode measures: a list of points, each a workload with its concurrency.

latency: batch 1, requests one after another. throughput: every request submitted at once
(at most `batch_size` in flight when a batch-size sweep is asked for). serve: Poisson arrivals
at each request rate. The standard grid is the H200 benchmark the team reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ingot.runtime.config import BuildConfig, ModelConfig
from ingot.runtime.errors import ConfigError

from .workload import Workload, check_fits, from_jsonl, point_seed, synthetic, with_poisson_arrivals

MODES = ("latency", "throughput", "serve")
GRIDS = ("standard",)


@dataclass(frozen=True)
class Options:
    """A benchmark as the command line asks for it (None: the mode's default)."""

    mode: str
    input_len: int = 128
    output_len: int = 128
    num_requests: int | None = None
    batch_sizes: tuple[int, ...] = ()
    request_rates: tuple[float, ...] = ()
    dataset: Path | None = None
    shared_prefix_len: int = 0
    seed: int = 0
    hf_num_requests: int | None = None
    hf_max_output_len: int | None = None


@dataclass(frozen=True)
class Point:
    name: str
    mode: str
    workload: Workload
    max_concurrency: int | None  # None: as many as the engine's max_batch_size allows
    hf_num_requests: int  # the baseline runs the first n requests of the workload
    batch_size: int | None = None
    request_rate: float | None = None
    hf_max_output_len: int | None = None  # the baseline's requests stop after this many tokens

    def hf_workload(self) -> Workload:
        """What the baseline runs: the first hf_num_requests requests, outputs capped."""
        return self.workload.head(self.hf_num_requests).capped(self.hf_max_output_len)

    @property
    def hf_outputs_capped(self) -> bool:
        cap = self.hf_max_output_len
        return cap is not None and any(it.output_len > cap for it in self.workload.items)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "max_concurrency": self.max_concurrency,
            "request_rate": self.request_rate,
            "workload": self.workload.describe(),
            "hf_num_requests": self.hf_num_requests,
            "hf_max_output_len": self.hf_max_output_len if self.hf_outputs_capped else None,
        }


def _workload(o: Options, name: str, n: int, m: ModelConfig) -> Workload:
    seed = point_seed(o.seed, name)
    if o.dataset is not None:
        return from_jsonl(o.dataset, m.vocab_size, seed, limit=o.num_requests)
    return synthetic(n, o.input_len, o.output_len, m.vocab_size, seed, o.shared_prefix_len)


def _hf_share(o: Options, w: Workload) -> dict:
    """The baseline's share of a point's workload: its first requests, outputs maybe capped."""
    n = len(w) if o.hf_num_requests is None else max(1, min(o.hf_num_requests, len(w)))
    return {"hf_num_requests": n, "hf_max_output_len": o.hf_max_output_len}


def latency_points(o: Options, m: ModelConfig, b: BuildConfig) -> list[Point]:
    name = f"latency_in{o.input_len}_out{o.output_len}"
    w = _workload(o, name, o.num_requests or 5, m)
    return [Point(name, "latency", w, 1, batch_size=1, **_hf_share(o, w))]


def throughput_points(o: Options, m: ModelConfig, b: BuildConfig) -> list[Point]:
    shape = "dataset" if o.dataset else f"in{o.input_len}_out{o.output_len}"
    points = []
    for bs in o.batch_sizes or (None,):
        if bs is not None and not 0 < bs <= b.max_batch_size:
            raise ConfigError(
                f"--batch-sizes {bs} is outside 1..{b.max_batch_size} (the engine's max_batch_size)",
                "rebuild with a larger --max-batch-size",
            )
        name = f"throughput_{shape}" + (f"_b{bs}" if bs else "")
        w = _workload(o, name, o.num_requests or bs or b.max_batch_size, m)
        batch = bs or b.max_batch_size
        points.append(Point(name, "throughput", w, bs, batch_size=batch, **_hf_share(o, w)))
    return points


def serve_points(o: Options, m: ModelConfig, b: BuildConfig) -> list[Point]:
    points = []
    for rate in o.request_rates or (2.0, 8.0, 32.0):
        name = f"serve_in{o.input_len}_out{o.output_len}_rate{rate:g}"
        seed = point_seed(o.seed, name)
        w = with_poisson_arrivals(_workload(o, name, o.num_requests or 32, m), rate, seed)
        points.append(Point(name, "serve", w, None, request_rate=rate, **_hf_share(o, w)))
    return points


# The H200 standard grid: (input, output, requests) per throughput point; HF caps beside.
STANDARD_THROUGHPUT = ((128, 128, 256), (128, 2048, 64), (2048, 128, 128), (2048, 2048, 64))
STANDARD_HF_THROUGHPUT_REQUESTS = 32
STANDARD_SERVE_RATES = (4.0, 16.0, 64.0)
# NOTE: transformers eager decodes ~10 steps/s on this model; 2,048 of them per point would
# alone outlast the grid's 10 minutes, so its long outputs stop at 128 tokens (rates compared).
STANDARD_HF_MAX_OUTPUT_LEN = 128


def standard_grid(o: Options, m: ModelConfig, b: BuildConfig) -> list[Point]:
    """latency at batch 1 (128 in / 128 out, 5 requests, HF 3); throughput at 128/128,
    128/2048, 2048/128, 2048/2048 (HF on its first 32 requests, outputs capped at 128 tokens,
    rates compared); serve
    128/128 at 4, 16 and 64 requests/s (128 requests, HF 16). `o.seed` applies; an explicit
    --num-requests / --hf-num-requests overrides every point's counts."""
    lat = replace(o, input_len=128, output_len=128, num_requests=o.num_requests or 5)
    points = latency_points(replace(lat, hf_num_requests=o.hf_num_requests or 3), m, b)
    for i, out, n in STANDARD_THROUGHPUT:
        t = replace(o, input_len=i, output_len=out, num_requests=o.num_requests or n)
        t = replace(t, hf_num_requests=o.hf_num_requests or STANDARD_HF_THROUGHPUT_REQUESTS)
        t = replace(t, hf_max_output_len=o.hf_max_output_len or STANDARD_HF_MAX_OUTPUT_LEN)
        points += throughput_points(replace(t, batch_sizes=()), m, b)
    s = replace(o, input_len=128, output_len=128, num_requests=o.num_requests or 128)
    s = replace(s, hf_num_requests=o.hf_num_requests or 16, request_rates=STANDARD_SERVE_RATES)
    return points + serve_points(s, m, b)


def build_points(o: Options, m: ModelConfig, b: BuildConfig, grid: str | None) -> list[Point]:
    if grid is not None:
        if grid not in GRIDS:
            raise ConfigError(f"unknown --grid {grid!r}", f"choose one of {', '.join(GRIDS)}")
        points = standard_grid(o, m, b)
    elif o.mode in MODES:
        points = {"latency": latency_points, "throughput": throughput_points}.get(
            o.mode, serve_points
        )(o, m, b)
    else:
        raise ConfigError(
            f"unknown mode {o.mode!r}", f"choose one of {', '.join(MODES)}, or pass --grid"
        )
    for p in points:
        check_fits(p.workload, b.max_seq_len)
    return points
