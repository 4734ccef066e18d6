"""Wall-clock laps of a multi-phase job (engine load, engine build)."""

from __future__ import annotations

import time

import torch


class Lap:
    """Records the seconds since the previous call under a name (device synchronized)."""

    def __init__(self, into: dict[str, float], device: torch.device) -> None:
        self.into, self.device, self.t = into, device, time.perf_counter()

    def __call__(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.into[name] = now - self.t
        self.t = now
