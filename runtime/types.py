"""Shared request types every layer imports (mini-sglang's `Req`/`SamplingParams` habit)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    """Why a request stopped. Values are shared with the C++ core (runtime/csrc)."""

    NONE = 0
    EOS = 1
    STOP = 2
    LENGTH = 3
    CANCELLED = 4
    REJECTED = 5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy; top_k 0 and top_p 1.0 mean off."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_words: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_prompt_logits: bool = False  # keep float32 logits of every prompt position (scoring)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class Request:
    """One generation request as the executor tracks it."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    error: str | None = None
    prompt_logits: list = field(default_factory=list)  # [n_i, V] chunks when asked for
    # time.perf_counter() when its prompt's first chunk was launched: the end of its wait in
    # the queue (benchmarks split time to first token into the two)
    first_launch: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.NONE
