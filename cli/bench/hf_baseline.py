"""The peer: transformers eager `generate` on the same workload, as a naive server would run it.

Static batching: whenever the model is idle it takes up to `max_concurrency` requests that
have arrived (FIFO), left-pads their prompts, and generates until the longest output in the
batch is done; a request's tokens beyond its own output length are generated but not counted
(reported as `hf_wasted_tokens`). Each token is timestamped by a logits processor, which
transformers calls once per generated token after the forward pass.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from .metrics import RunResult, Trace, peak_memory, reset_peak_memory
from .roofline import DecodeStep
from .workload import Workload


class StepStamps:
    """Logits processor that records when each generation step's logits are ready."""

    def __init__(self, device: torch.device, t0: float) -> None:
        self.device, self.t0, self.times = device, t0, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter() - self.t0)
        return scores


class HFDriver:
    name = "hf"

    def __init__(self, model: Any, device: torch.device, max_batch_size: int) -> None:
        self.model = model
        self.device = device
        self.max_batch_size = max_batch_size

    def close(self) -> None:
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, w: Workload, max_concurrency: int | None = None) -> RunResult:
        batch_limit = max_concurrency or self.max_batch_size
        traces = [
            Trace(a, it.input_len, it.output_len) for it, a in zip(w.items, w.arrivals, strict=True)
        ]
        order = sorted(range(len(w)), key=lambda i: w.arrivals[i])
        steps: list[DecodeStep] = []
        wasted = pos = 0
        batches: list[int] = []
        reset_peak_memory(self.device)
        t0 = time.perf_counter()
        while pos < len(order):
            now = time.perf_counter() - t0
            if w.arrivals[order[pos]] > now:
                time.sleep(w.arrivals[order[pos]] - now)
                continue
            batch = []
            while pos < len(order) and len(batch) < batch_limit and w.arrivals[order[pos]] <= now:
                batch.append(order[pos])
                pos += 1
                if max_concurrency is not None:  # closed loop, as on the ingot side
                    traces[batch[-1]].arrival = max(traces[batch[-1]].arrival, now)
            wasted += self._generate(w, batch, traces, steps, t0)
            batches.append(len(batch))
        return RunResult(
            traces,
            steps,
            peak_memory(self.device),
            extra={
                "hf_batches": len(batches),
                "hf_mean_batch_size": sum(batches) / len(batches),
                "hf_wasted_tokens": wasted,
            },
        )

    def _generate(
        self,
        w: Workload,
        batch: list[int],
        traces: list[Trace],
        steps: list[DecodeStep],
        t0: float,
    ) -> int:
        """Generate one static batch; returns the tokens made beyond requests' lengths."""
        from transformers import LogitsProcessorList

        items = [w.items[i] for i in batch]
        width = max(it.input_len for it in items)
        new = max(it.output_len for it in items)
        ids = torch.zeros(len(items), width, dtype=torch.long)
        mask = torch.zeros(len(items), width, dtype=torch.long)
        for row, it in enumerate(items):  # left padding: prompts end where generation starts
            ids[row, width - it.input_len :] = torch.tensor(it.prompt_ids)
            mask[row, width - it.input_len :] = 1
        stamp = StepStamps(self.device, t0)
        with torch.no_grad():
            self.model.generate(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=False,
                max_new_tokens=new,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamp]),
            )
        times = stamp.times
        for i, it in zip(batch, items, strict=True):
            traces[i].token_times = times[: it.output_len]
            traces[i].generated = len(traces[i].token_times)
        b = len(items)
        for j in range(1, len(times)):
            # step j reads the KV of the padded prompt plus j tokens for every row
            steps.append(DecodeStep(times[j] - times[j - 1], b, b * (width + j)))
        return b * len(times) - sum(min(it.output_len, len(times)) for it in items)
