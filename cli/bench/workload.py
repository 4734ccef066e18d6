"""Benchmark workloads: token ids, output lengths and arrival times, all drawn from a seed.

The same seed gives the same workload on every machine and every ingot version, so runs are
comparable. Each benchmark point derives its own seed from the base seed and its name, so
two points never share prompts (no accidental prefix-cache hits between points).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ingot.runtime.errors import ConfigError
from ingot.runtime.user_files import read_user_text

_JSONL_HINT = 'write one JSON object a line: {"input_len": N, "output_len": M}'


@dataclass(frozen=True)
class Item:
    """One request of a workload: its prompt and how many tokens it must generate."""

    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    """Requests with their arrival times (seconds from the start; all 0 = submitted at once)."""

    items: tuple[Item, ...]
    arrivals: tuple[float, ...]
    seed: int
    source: str  # "synthetic" or the dataset path

    def __post_init__(self) -> None:
        if len(self.items) != len(self.arrivals):
            raise ValueError("one arrival time per item")

    def __len__(self) -> int:
        return len(self.items)

    def head(self, n: int) -> Workload:
        """The first n requests (same prompts, same arrival times): the reduced HF baseline."""
        return Workload(self.items[:n], self.arrivals[:n], self.seed, self.source)

    def capped(self, max_output_len: int | None) -> Workload:
        """The same requests, each generating at most `max_output_len` tokens (None: as is)."""
        if max_output_len is None:
            return self
        items = tuple(Item(it.prompt_ids, min(it.output_len, max_output_len)) for it in self.items)
        return Workload(items, self.arrivals, self.seed, self.source)

    def describe(self) -> dict:
        ins = [it.input_len for it in self.items]
        outs = [it.output_len for it in self.items]
        return {
            "source": self.source,
            "seed": self.seed,
            "num_requests": len(self.items),
            "input_len": {"min": min(ins), "mean": float(np.mean(ins)), "max": max(ins)},
            "output_len": {"min": min(outs), "mean": float(np.mean(outs)), "max": max(outs)},
            "input_tokens": sum(ins),
            "output_tokens": sum(outs),
        }


def point_seed(base: int, name: str) -> int:
    """A stable per-point seed (crc32 is the same on every platform and Python version)."""
    return (base * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=n))


def synthetic(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    shared_prefix_len: int = 0,
) -> Workload:
    """Fixed lengths, uniform random token ids; the first `shared_prefix_len` ids are common
    to every prompt (exercises prefix reuse). All requests arrive at time 0."""
    if num_requests <= 0 or input_len <= 0 or output_len <= 0:
        raise ConfigError(
            f"workload needs positive sizes, got {num_requests} requests of "
            f"{input_len} in / {output_len} out"
        )
    if not 0 <= shared_prefix_len <= input_len:
        raise ConfigError(
            f"--shared-prefix-len {shared_prefix_len} must be between 0 and --input-len {input_len}"
        )
    rng = np.random.default_rng(seed)
    prefix = _token_ids(rng, shared_prefix_len, vocab_size)
    items = tuple(
        Item(prefix + _token_ids(rng, input_len - shared_prefix_len, vocab_size), output_len)
        for _ in range(num_requests)
    )
    return Workload(items, (0.0,) * num_requests, seed, "synthetic")


def from_jsonl(path: Path, vocab_size: int, seed: int, limit: int | None = None) -> Workload:
    """One request per line: {"input_len": N, "output_len": M} (token ids drawn from the seed)
    or {"prompt_ids": [...], "output_len": M}. All requests arrive at time 0."""
    text = read_user_text(path, f"--dataset {path}", _JSONL_HINT)
    rng = np.random.default_rng(seed)
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out = int(row["output_len"])
            ids = row.get("prompt_ids")
            ids = (
                tuple(int(t) for t in ids)
                if ids
                else _token_ids(rng, int(row["input_len"]), vocab_size)
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{path}:{lineno} is not a request ({e!r})",
                _JSONL_HINT,
            ) from None
        if not ids or out <= 0 or any(not 0 <= t < vocab_size for t in ids):
            raise ConfigError(
                f"{path}:{lineno}: need input_len > 0, output_len > 0 and ids below {vocab_size}"
            )
        items.append(Item(ids, out))
        if limit is not None and len(items) == limit:
            break
    if not items:
        raise ConfigError(f"--dataset {path} holds no request")
    return Workload(tuple(items), (0.0,) * len(items), seed, str(path))


def with_poisson_arrivals(w: Workload, rate: float, seed: int) -> Workload:
    """The same requests arriving as a Poisson process of `rate` requests/s (first at 0)."""
    if rate <= 0:
        raise ConfigError(f"request rates must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(w.items))
    gaps[0] = 0.0
    return Workload(w.items, tuple(float(t) for t in np.cumsum(gaps)), w.seed, w.source)


def check_fits(w: Workload, max_seq_len: int) -> None:
    """Every request must fit the engine (prompt + output <= max_seq_len)."""
    worst = max(it.input_len + it.output_len for it in w.items)
    if worst > max_seq_len:
        raise ConfigError(
            f"a request needs {worst} tokens (prompt + output) but the engine's max_seq_len is "
            f"{max_seq_len}",
            "shorten --input-len/--output-len or rebuild with a larger --max-seq-len",
        )
