"""Drives ingot's Executor in-process: requests join at their arrival times between steps,
each token is timestamped in the step callback. No server, no network."""

from __future__ import annotations

import gc
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ingot.runtime.engine import load_engine
from ingot.runtime.errors import ConfigError
from ingot.runtime.executor import Executor
from ingot.runtime.types import Request, SamplingParams

from .metrics import (
    RunResult,
    StepMix,
    Trace,
    allocator_counts,
    allocator_delta,
    peak_memory,
    reset_peak_memory,
)
from .roofline import DecodeStep
from .workload import Workload


class IngotDriver:
    """One Executor for every point of a benchmark (the KV pool is sized once)."""

    name = "ingot"

    def __init__(
        self,
        engine_dir: Path,
        device: torch.device | None = None,
        num_kv_blocks: int | None = None,
        policy: str = "guaranteed_no_evict",
        enable_prefix_reuse: bool = True,
        kv_cache_free_gpu_memory_fraction: float = 0.9,
        cuda_graphs: bool = True,
        pipeline: bool = True,
    ) -> None:
        self.engine = load_engine(Path(engine_dir), device)
        self.executor = Executor(
            self.engine,
            device,
            num_kv_blocks=num_kv_blocks,
            policy=policy,
            enable_prefix_reuse=enable_prefix_reuse,
            kv_cache_free_gpu_memory_fraction=kv_cache_free_gpu_memory_fraction,
            cuda_graphs=cuda_graphs,
            pipeline=pipeline,
        )
        self.device = self.executor.device

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.executor.decoder.w

    @property
    def kv_element_size(self) -> int:
        return self.executor.kv.data.element_size()

    def close(self) -> None:
        """Free the weights and the KV pool (before the baseline loads its model)."""
        del self.executor
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, w: Workload, max_concurrency: int | None = None) -> RunResult:
        """Serve `w`: request i is added at the first step boundary after w.arrivals[i], and
        only while fewer than `max_concurrency` requests are unfinished (None: no limit; the
        engine's max_batch_size still bounds each step). With a limit the run is a closed loop
        and a request's latency counts from when it was submitted, not from time 0."""
        ex = self.executor
        traces = [
            Trace(a, it.input_len, it.output_len) for it, a in zip(w.items, w.arrivals, strict=True)
        ]
        order = deque(sorted(range(len(w)), key=lambda i: w.arrivals[i]))
        index: dict[int, int] = {}
        added: list[tuple[int, Request]] = []  # (workload index, request): for its queue time
        steps: list[DecodeStep] = []
        mix = StepMix()
        used, util = [], []
        before = ex.scheduler.stats()
        reset_peak_memory(self.device)
        alloc_before = allocator_counts(self.device)
        t0 = time.perf_counter()

        def on_token(req: Request, _tok: int) -> None:
            traces[index[req.request_id]].token_times.append(time.perf_counter() - t0)

        in_flight = 0
        last_end = time.perf_counter()
        while order or ex.has_unfinished():
            now = time.perf_counter() - t0
            while order and w.arrivals[order[0]] <= now:
                if max_concurrency is not None and in_flight >= max_concurrency:
                    break
                i = order.popleft()
                it = w.items[i]
                params = SamplingParams(max_new_tokens=it.output_len, ignore_eos=True)
                req = ex.add_request(list(it.prompt_ids), params)
                if req.finished:
                    raise ConfigError(f"the engine refused a benchmark request: {req.error}")
                index[req.request_id] = i
                added.append((i, req))
                in_flight += 1
                if max_concurrency is not None:  # closed loop: latency counts from submission
                    traces[i].arrival = max(traces[i].arrival, time.perf_counter() - t0)
            if not ex.has_unfinished():
                time.sleep(max(0.0, w.arrivals[order[0]] - (time.perf_counter() - t0)))
                last_end = time.perf_counter()  # idle waiting for arrivals is not host work
                continue
            t = time.perf_counter()
            between = t - last_end  # the driver's own work since the last step
            done = ex.step(on_token)
            last_end = time.perf_counter()
            dt = last_end - t
            # the step this call read back (pipelined, it launched the next one too)
            num_seqs, num_prefill, ctx, tokens = ex.last_step
            if num_seqs and not num_prefill:
                steps.append(DecodeStep(dt, num_seqs, ctx))
            mix.add(dt, num_seqs, num_prefill, tokens, (*ex.step_phases, between))
            s = ex.scheduler.stats()
            used.append(s["used_blocks"])
            util.append(s["kv_utilization"])
            for req in done:
                traces[index[req.request_id]].generated = len(req.output_ids)
            in_flight -= len(done)
        for i, req in added:
            if req.first_launch is not None:
                traces[i].started = req.first_launch - t0
        after = ex.scheduler.stats()
        hit = after["prefix_hit_blocks"] - before["prefix_hit_blocks"]
        miss = after["prefix_miss_blocks"] - before["prefix_miss_blocks"]
        return RunResult(
            traces,
            steps,
            peak_memory(self.device),
            kv_cache={
                "num_blocks": ex.kv.num_blocks,
                "tokens_per_block": ex.kv.tokens_per_block,
                "pool_bytes": ex.kv.nbytes,
                "peak_used_blocks": max(used, default=0),
                "peak_utilization": max(util, default=0.0),
                "mean_utilization": float(np.mean(util)) if util else 0.0,
                "preemptions": after["num_preemptions"] - before["num_preemptions"],
            },
            prefix_cache={
                "hit_blocks": hit,
                "miss_blocks": miss,
                "hit_tokens": after["prefix_hit_tokens"] - before["prefix_hit_tokens"],
                # NOTE: None when no full prompt block was looked up (e.g. one-block prompts).
                "hit_rate": hit / (hit + miss) if hit + miss else None,
            },
            extra={
                "steps": len(used),
                "step_mix": mix.to_dict(),
                "allocator": allocator_delta(alloc_before, allocator_counts(self.device)),
            },
        )
