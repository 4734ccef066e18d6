"""What a run records (per-request token timestamps, decode steps) and the figures made of it.

Both systems (ingot and the Hugging Face baseline) fill the same `RunResult`, so every figure
and every ratio is computed by the same code.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from .roofline import DecodeStep, Roofline


@dataclass
class Trace:
    """One request: scheduled arrival and the time each of its tokens came out (seconds from
    the run's start), requested and generated output lengths."""

    arrival: float
    input_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    generated: int = 0  # tokens the system reports for this request when it finished
    # when its prompt's first chunk was launched (ingot; None for the baseline): the time
    # to first token minus this wait in the queue is the request's own prefill
    started: float | None = None


class StepMix:
    """Where a run's step time went, by kind of step: decode-only, prefill-only, and mixed
    (prefill chunks beside decodes). Per kind: steps, seconds, tokens computed, sequences, and
    the mean host milliseconds of each executor phase (`Executor.STEP_PHASES`) plus the
    driver's own time before the step ("between": arrivals, statistics)."""

    KINDS = ("decode", "prefill", "mixed")
    PHASES = ("start", "next", "readback", "settle", "between")

    def __init__(self) -> None:
        self._sums = {k: [0, 0.0, 0, 0] for k in self.KINDS}
        self._phases = {k: [0.0] * len(self.PHASES) for k in self.KINDS}

    @staticmethod
    def kind(num_seqs: int, num_prefill: int) -> str:
        """A step's kind: decode-only, prefill-only or mixed."""
        return "decode" if num_prefill == 0 else "prefill" if num_prefill == num_seqs else "mixed"

    def add(
        self,
        seconds: float,
        num_seqs: int,
        num_prefill: int,
        tokens: int,
        phases: tuple[float, ...] = (),
    ) -> None:
        """phases: seconds by PHASES (a prefix of them, or none)."""
        if not num_seqs:
            return
        kind = self.kind(num_seqs, num_prefill)
        row = self._sums[kind]
        row[0] += 1
        row[1] += seconds
        row[2] += tokens
        row[3] += num_seqs
        acc = self._phases[kind]
        for i, sec in enumerate(phases):
            acc[i] += sec

    def to_dict(self) -> dict:
        out = {}
        for kind, (n, sec, tok, seqs) in self._sums.items():
            out[kind] = {
                "steps": n,
                "seconds": sec,
                "tokens": tok,
                "mean_seqs": seqs / n if n else None,
                "mean_ms": 1e3 * sec / n if n else None,
                "phase_mean_ms": {
                    p: 1e3 * v / n if n else None
                    for p, v in zip(self.PHASES, self._phases[kind], strict=True)
                },
            }
        return out


@dataclass
class RunResult:
    traces: list[Trace]
    decode_steps: list[DecodeStep]
    memory: dict
    kv_cache: dict | None = None  # ingot only
    prefix_cache: dict | None = None  # ingot only
    extra: dict = field(default_factory=dict)


def dist(values: list[float], scale: float = 1.0) -> dict | None:
    """mean / p50 / p90 / p99 / max (linear interpolation: ordered by construction)."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """GPU: torch.cuda.max_memory_allocated since the phase began. CPU: there is no allocator
    counter, so the process's peak resident set size (whole process, all phases) instead."""
    if device.type == "cuda":
        return {
            "gpu_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "process_peak_rss_bytes": None,
            "kind": "torch.cuda.max_memory_allocated during this run",
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return {
        "gpu_peak_allocated_bytes": None,
        "process_peak_rss_bytes": int(rss),
        "kind": "CPU run: peak RSS of the whole process so far (not per run)",
    }


# The caching allocator's slow paths during a run. A retry (an allocation that found no cached
# block and no free device memory) frees every cached block through cudaFree, which waits for
# the whole device, so a pipelined executor's next step stops overlapping the current one;
# device allocs / frees count cudaMalloc / cudaFree calls.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")


def allocator_counts(device: torch.device) -> dict[str, int] | None:
    """The allocator's counters now (None off CUDA: no caching allocator to count)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def allocator_delta(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """What the counters of `allocator_counts` grew by between two readings."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in ALLOCATOR_COUNTERS}


def summarize(run: RunResult, roofline: Roofline) -> dict:
    """The figures of one run. Elapsed runs from the first arrival to the last token."""
    tr = run.traces
    start = min(t.arrival for t in tr)
    end = max((t.token_times[-1] for t in tr if t.token_times), default=start)
    elapsed = end - start
    out_tokens = sum(len(t.token_times) for t in tr)
    in_tokens = sum(t.input_len for t in tr)
    ttft = [t.token_times[0] - t.arrival for t in tr if t.token_times]
    queue = [t.started - t.arrival for t in tr if t.started is not None]
    itl = [b - a for t in tr for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    e2e = [t.token_times[-1] - t.arrival for t in tr if t.token_times]
    per_req_decode = [
        (len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
        for t in tr
        if len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]
    ]
    rate = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: None)
    return {
        "num_requests": len(tr),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,  # counted from the per-token timestamps
        "output_tokens_generated": sum(t.generated for t in tr),  # as the system reports
        "output_tokens_requested": sum(t.output_len for t in tr),
        "elapsed_s": elapsed,
        "requests_per_s": rate(len(tr)),
        "output_tok_s": rate(out_tokens),
        "total_tok_s": rate(in_tokens + out_tokens),
        "ttft_ms": dist(ttft, 1e3),
        # arrival to the launch of its first prompt chunk: at a throughput point every request
        # arrives at once, so those past the first steps' batch wait here
        "queue_ms": dist(queue, 1e3),
        "itl_ms": dist(itl, 1e3),
        "e2e_latency_ms": dist(e2e, 1e3),
        # per request (tokens after the first) / (time from first to last token)
        "decode_tok_s_per_request": dist(per_req_decode),
        "decode": roofline.decode_figure(run.decode_steps),
        "memory": run.memory,
        "kv_cache": run.kv_cache,
        "prefix_cache": run.prefix_cache,
        **run.extra,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _p(m: dict, key: str, q: str) -> float | None:
    return (m.get(key) or {}).get(q)


def compare(mode: str, ours: dict, hf: dict, outputs_capped: bool = False) -> dict:
    """ingot against the baseline. `*_ratio`: ingot / hf of a rate (higher is better for
    ingot); `*_speedup`: hf / ingot of a latency (higher is better for ingot). Rates and
    per-request latencies do not depend on how many requests ran, so they stay comparable
    when the baseline ran fewer requests. outputs_capped: the baseline's requests stopped
    early, so whole-request figures (requests/s, end-to-end latency) are left out (None)."""
    out = {
        "output_tok_s_ratio": _ratio(ours["output_tok_s"], hf["output_tok_s"]),
        "total_tok_s_ratio": _ratio(ours["total_tok_s"], hf["total_tok_s"]),
        "requests_per_s_ratio": _ratio(ours["requests_per_s"], hf["requests_per_s"]),
    }
    for key in ("ttft_ms", "itl_ms", "e2e_latency_ms"):
        for q in ("p50", "p99"):
            out[f"{key.removesuffix('_ms')}_{q}_speedup"] = _ratio(_p(hf, key, q), _p(ours, key, q))
    out["decode_tok_s_per_request_ratio"] = _ratio(
        _p(ours, "decode_tok_s_per_request", "mean"), _p(hf, "decode_tok_s_per_request", "mean")
    )
    if outputs_capped:
        out.update(dict.fromkeys(("requests_per_s_ratio", "e2e_latency_p50_speedup",
                                  "e2e_latency_p99_speedup")))  # fmt: skip
    if mode == "latency":
        out = {k: v for k, v in out.items() if not k.startswith(("total", "requests"))}
    return out
