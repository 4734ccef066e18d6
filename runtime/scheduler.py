"""Inflight-batching scheduler and paged KV block manager: the Python API over the C++ core.

The bookkeeping lives in `ingot.runtime._core` (runtime/csrc, DESIGN.md decision 4). This
module validates configs, turns core errors into ingot's typed errors and wraps each step's
plan as numpy views over C++-owned buffers (no per-element Python work per step).

A sequence holds `tokens` (prompt + generated) and `num_computed` (tokens whose KV is in the
cache). Each step, every scheduled sequence computes tokens [num_computed, num_computed + n):
a prefill chunk or a decode (n == 1). An entry samples a new token exactly when
num_computed + n == len(tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import _core
from .errors import RequestError
from .types import FinishReason

POLICIES = ("guaranteed_no_evict", "max_utilization")

#: The standalone block manager (tests, tools): check-then-commit calls keyed by sequence id.
#: BlockManager(num_blocks, tokens_per_block, enable_prefix_reuse=True, hash_bits=64) with
#: can_allocate/allocate(seq_id, tokens: int32 array) -> reused tokens, can_append/append(
#: seq_id, num_tokens), mark_computed(seq_id, tokens, num_computed), free(seq_id) -> bool,
#: block_table(seq_id) -> int32 view, ref_count(block), num_free_blocks(), num_cached_blocks(),
#: num_used_blocks(), stats() and check_integrity() -> "" or the first violation.
BlockManager = _core.BlockManager

_REASONS = tuple(FinishReason)


@dataclass(frozen=True)
class SchedulerConfig:
    """Pool and batch limits. Validated on construction (ValueError naming the parameter).

    num_blocks: KV blocks in the pool; tokens_per_block: tokens per block;
    max_batch_size: sequences per step; max_num_tokens: tokens per step (prefill chunks +
    decodes); max_seq_len: tokens per sequence (prompt + generated);
    policy: "guaranteed_no_evict" (admit only when the request's whole KV fits in blocks not
    promised to others) or "max_utilization" (admit greedily, preempt the most recently
    admitted request when a running one cannot grow); enable_prefix_reuse: KV cache reuse of
    identical full-block prefixes.
    """

    num_blocks: int
    tokens_per_block: int = 16
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: int = 2048
    policy: str = "guaranteed_no_evict"
    enable_prefix_reuse: bool = True

    def __post_init__(self) -> None:
        for name in (
            "num_blocks",
            "tokens_per_block",
            "max_batch_size",
            "max_num_tokens",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
            if value >= 2**31:
                raise ValueError(f"{name} must be < 2**31, got {value}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of StepPlan.block_tables: ceil(max_seq_len / tokens_per_block)."""
        return -(-self.max_seq_len // self.tokens_per_block)


class StepPlan:
    """One step's work. Prefill entries come first, then decodes; B entries, T tokens.

    Arrays are views into the scheduler's C++ buffers, valid until the next `schedule()`:
    seq_ids int64[B]; num_new_tokens, num_computed (start position), context_lens
    (= num_computed + num_new_tokens) int32[B]; query_start_loc int32[B+1] (prefix sums of
    num_new_tokens); samples bool[B]; input_ids, positions, slot_mapping (block_id *
    tokens_per_block + offset where the new KV goes) int32[T]; block_tables
    int32[B, max_blocks_per_seq] padded with 0. `preempted` lists ids preempted this step.
    """

    __slots__ = ("num_seqs", "num_tokens", "num_prefill", "preempted", "_buf")

    def __init__(
        self,
        num_seqs: int,
        num_tokens: int,
        num_prefill: int,
        preempted: list[int],
        buffers: dict[str, np.ndarray],
    ) -> None:
        self.num_seqs, self.num_tokens, self.num_prefill = num_seqs, num_tokens, num_prefill
        self.preempted = preempted
        self._buf = buffers

    def _b(self, name: str) -> np.ndarray:
        return self._buf[name][: self.num_seqs]

    def _t(self, name: str) -> np.ndarray:
        return self._buf[name][: self.num_tokens]

    seq_ids = property(lambda self: self._b("seq_ids"))
    num_new_tokens = property(lambda self: self._b("num_new_tokens"))
    num_computed = property(lambda self: self._b("num_computed"))
    context_lens = property(lambda self: self._b("context_lens"))
    samples = property(lambda self: self._b("samples"))
    block_tables = property(lambda self: self._b("block_tables"))
    input_ids = property(lambda self: self._t("input_ids"))
    positions = property(lambda self: self._t("positions"))
    slot_mapping = property(lambda self: self._t("slot_mapping"))
    query_start_loc = property(lambda self: self._buf["query_start_loc"][: self.num_seqs + 1])

    def __repr__(self) -> str:
        return (
            f"StepPlan(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, "
            f"num_prefill={self.num_prefill}, preempted={self.preempted})"
        )


class Scheduler:
    """Admission, chunked prefill, decode, preemption and cancellation over a paged KV pool.

    Not thread-safe. Call order per step: `schedule()`, run the model on the plan, then
    `update()` with its results; `add_request` and `cancel` may come at any point.
    """

    def __init__(self, config: SchedulerConfig, *, _hash_bits: int = 64) -> None:
        """Builds an empty scheduler. `_hash_bits` < 64 truncates block hashes (tests only)."""
        self.config = config
        c = config
        self._core = _core.Scheduler(
            c.num_blocks,
            c.tokens_per_block,
            c.max_batch_size,
            c.max_num_tokens,
            c.max_seq_len,
            POLICIES.index(c.policy),
            c.enable_prefix_reuse,
            _hash_bits,
        )
        self._buffers: dict[str, np.ndarray] = self._core.plan_buffers()

    def add_request(
        self, req_id: int, prompt: Sequence[int] | np.ndarray, max_new_tokens: int
    ) -> None:
        """Queues request `req_id` (int64) behind the waiting ones.

        Raises RequestError (scheduler unchanged) when the prompt length is >= max_seq_len or
        needs more blocks than the pool holds; ValueError for a duplicate id, an empty prompt
        or max_new_tokens <= 0. Tokens are copied.
        """
        tokens = np.ascontiguousarray(prompt, dtype=np.int32)
        if tokens.ndim != 1:
            raise ValueError(f"request {req_id}: prompt must be 1-D, got shape {tokens.shape}")
        try:
            self._core.add_request(req_id, tokens, max_new_tokens)
        except _core.RequestRefused as e:
            raise RequestError(
                str(e), hint="shorten the prompt or raise max_seq_len / the KV pool"
            ) from None

    def schedule(self) -> StepPlan:
        """Plans the next step and reserves its KV blocks.

        Returns a StepPlan (num_seqs == 0 when nothing can run). Under max_utilization it may
        preempt running requests (listed in plan.preempted; their blocks are freed and they
        wait at the front of the queue to recompute). Raises RuntimeError if the previous
        non-empty plan was not passed to `update()`.
        """
        b, t, p, preempted = self._core.schedule()
        return StepPlan(b, t, p, preempted, self._buffers)

    def update(self, new_tokens: np.ndarray, finish: np.ndarray) -> list[tuple[int, FinishReason]]:
        """Applies the model step for the last plan.

        new_tokens int32[B], finish int8[B] are aligned with the plan's entries; only entries
        with samples set use them: new_tokens[i] is appended, finish[i] is NONE or a reason
        decided by Python (EOS/STOP). The core adds LENGTH when a request reaches
        max_new_tokens or max_seq_len. Advances num_computed of every entry, caches blocks
        that became full. Returns (req_id, reason) of each request that finished now; their
        blocks are released (full blocks stay cached). Raises ValueError on a length mismatch
        or invalid reason, RuntimeError without a pending plan.
        """
        if not (isinstance(new_tokens, np.ndarray) and new_tokens.dtype == np.int32):
            new_tokens = np.ascontiguousarray(new_tokens, dtype=np.int32)
        if not (isinstance(finish, np.ndarray) and finish.dtype == np.int8):
            finish = np.ascontiguousarray(finish, dtype=np.int8)
        done = self._core.update(new_tokens, finish)
        return [(rid, _REASONS[r]) for rid, r in done] if done else []

    def set_last_tokens(self, req_ids: np.ndarray, tokens: np.ndarray) -> int:
        """Replaces the last token of each request (live, or finished since the last update())
        by `tokens` (aligned; unknown ids are skipped); returns how many were replaced. For a
        pipelined executor: `update()` received placeholders for tokens the device had not
        sampled yet. The last token is never computed yet, so no block hash has read it."""
        ids = np.ascontiguousarray(req_ids, dtype=np.int64)
        return self._core.set_last_tokens(ids, np.ascontiguousarray(tokens, dtype=np.int32))

    def cancel(self, req_id: int) -> bool:
        """Drops a waiting or running request (also between schedule and update: its entry is
        then ignored). Frees every block it held. Returns False if the id is not live."""
        return self._core.cancel(req_id)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return self._core.has_unfinished()

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached ones."""
        return self._core.num_free_blocks()

    def stats(self) -> dict:
        """Counters: prefix_hit_blocks, prefix_miss_blocks, prefix_hit_tokens,
        num_preemptions, num_running, num_waiting, used_blocks, cached_blocks (evictable),
        free_blocks (neither used nor cached), kv_utilization (used / num_blocks)."""
        return self._core.stats()

    def check_integrity(self) -> None:
        """Raises AssertionError naming the first violated invariant: a block owned twice or
        leaked, a refcount != owners, an inconsistent free/LRU list or hash map, a cached block
        with other tokens than its sequence, or a running table not covering its tokens."""
        msg = self._core.check_integrity()
        if msg:
            raise AssertionError(f"scheduler integrity: {msg}")

    def tokens(self, req_id: int) -> np.ndarray:
        """int32 copy of prompt + generated tokens of a live request, or of one that finished
        or was cancelled since the previous update(). KeyError otherwise."""
        return self._core.tokens(req_id)

    def ref_count(self, block: int) -> int:
        """Owners of `block` (tests)."""
        return self._core.ref_count(block)
