"""Grids of resident (persistent) programs: a fixed number per SM, each walking several tiles."""

from __future__ import annotations

import torch

_SMS: dict[int, int] = {}


def resident_grid(tiles: int, persist: int, device: torch.device) -> int:
    """Programs of a persistent launch: `persist` per SM of the device, at most one a tile.
    Without a CUDA device (the interpreter, the AOT dry run on "meta") one SM's worth."""
    if device.type == "cuda":
        i = device.index if device.index is not None else torch.cuda.current_device()
        if i not in _SMS:
            _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
        sms = _SMS[i]
    else:
        sms = 1
    return max(1, min(tiles, sms * persist))
