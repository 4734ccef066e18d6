"""A step's int32 input arrays to the device in one copy.

Each eager step (prefill chunks, mixed steps, anything the CUDA graphs do not take) needs its
token ids, positions, slots, block tables, context lengths and query offsets on the device.
Copied one by one from pageable numpy memory, every copy is synchronous: on the H200 the 2,048-
token prefill spent about 0.2 ms in seven such copies and the launch gaps after them before its
first kernel. Here they go through one reusable pinned buffer and one asynchronous copy.
"""

from __future__ import annotations

import numpy as np
import torch


def recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far, to wait on before the host reuses a pinned
    buffer an asynchronous copy reads or fills (None off CUDA: there every copy has finished
    when it returns; Triton's interpreter runs the graph classes on the CPU in the tests)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def segments(sizes: list[int]) -> tuple[list[int], int]:
    """(start of each segment, total length) for int32 segments of `sizes`, each starting
    16-byte aligned: Triton specializes kernels on pointer alignment, and the ahead-of-time
    bundle holds the aligned variants only."""
    starts, end = [], 0
    for n in sizes:
        starts.append(end)
        end += -(-n // 4) * 4
    return starts, end


class StepInputs:
    """Reusable pinned staging buffer; `put` returns device views of the arrays."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host

    def put(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        flat = {k: np.ascontiguousarray(a, dtype=np.int32) for k, a in arrays.items()}
        starts, end = segments([a.size for a in flat.values()])
        if self._host.numel() < end:
            self._host = torch.empty(max(end, 2 * self._host.numel()), dtype=torch.int32,
                                     pin_memory=self._cuda)  # fmt: skip
        elif self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the buffer
        h = self._host.numpy()
        for a, s in zip(flat.values(), starts, strict=True):
            h[s : s + a.size] = a.reshape(-1)
        dev = torch.empty(end, dtype=torch.int32, device=self.device)
        dev.copy_(self._host[:end], non_blocking=self._cuda)
        self._copied = recorded_event(self.device)
        return {
            k: dev[s : s + a.size].view(a.shape)
            for (k, a), s in zip(flat.items(), starts, strict=True)
        }
