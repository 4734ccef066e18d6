"""The memory-bandwidth roofline of decode: bytes a step must read over the measured bandwidth.

A decode step reads every weight once (all but the embedding table, of which it reads one row
per token, and the RoPE tables, likewise; with tied embeddings the table is the LM head and is
read whole) plus the KV cache of every sequence up to its current length. Its time cannot be
below bytes / bandwidth, so tok/s cannot exceed tokens_per_step * bandwidth / bytes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ingot.runtime.config import ModelConfig

CUDA_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 256 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 5) -> dict:
    """Copy bandwidth (bytes read + bytes written per second) of one large buffer copy:
    device-to-device on a GPU, a memcpy in host memory on the CPU. Best of `iters`."""
    nbytes = nbytes or (CUDA_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in both buffers
    _sync(device)
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return {
        "bytes_per_s": 2 * nbytes / best,
        "method": (
            f"{'device-to-device' if device.type == 'cuda' else 'host memcpy'} copy of "
            f"{nbytes / 2**20:.0f} MiB, best of {iters}, read + write bytes"
        ),
    }


def decode_weight_bytes(weights: Mapping[str, torch.Tensor], model: ModelConfig) -> int:
    """Bytes of weights one decode step reads (scales of quantized weights included)."""
    skip_embed = "lm_head.weight" in weights or not model.tie_word_embeddings
    total = 0
    for name, t in weights.items():
        if name.startswith("rope.") or (name == "embed.weight" and skip_embed):
            continue
        total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class DecodeStep:
    """One decode-only step: its wall time, sequences in it (= tokens made), KV tokens read."""

    seconds: float
    num_seqs: int
    context_tokens: int


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth_bytes_per_s: float

    def step_bytes(self, context_tokens: int) -> int:
        return self.weight_bytes + context_tokens * self.kv_bytes_per_token

    def decode_figure(self, steps: list[DecodeStep]) -> dict | None:
        """Decode tok/s over the decode-only steps and its fraction of the roofline."""
        if not steps:
            return None
        seconds = sum(s.seconds for s in steps)
        tokens = sum(s.num_seqs for s in steps)
        nbytes = sum(self.step_bytes(s.context_tokens) for s in steps)
        limit_s = nbytes / self.bandwidth_bytes_per_s
        tok_s = tokens / seconds if seconds > 0 else None
        return {
            "steps": len(steps),
            "tokens": tokens,
            "seconds": seconds,
            "tok_s": tok_s,
            "mean_batch": tokens / len(steps),
            "mean_context_tokens_per_seq": sum(s.context_tokens for s in steps) / tokens,
            "mean_bytes_per_step": nbytes / len(steps),
            "roofline_tok_s": tokens / limit_s,
            # NOTE: = roofline time / measured time; <= 1 unless the bandwidth was mismeasured.
            "fraction_of_roofline": limit_s / seconds if seconds > 0 else None,
        }

    def to_dict(self) -> dict:
        return {
            "weight_bytes_per_step": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
        }
