"""A launched step whose tokens the host has not read yet, and the pinned buffers they come
back through.

The executor pipelines steps (executor.py, `Executor.step`): while the device runs step k+1,
the host reads step k's tokens and does its bookkeeping. So the argmax of a step travels to
the host by an asynchronous copy into one of two pinned buffers (the next step's copy must not
land in the buffer being read), and an event says when it has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .step_inputs import recorded_event
from .types import Request


@dataclass
class Launched:
    """One step on the device. Rows are the plan's sampling rows, in plan order."""

    num_seqs: int  # the plan's entries (the scheduler's update takes one per entry)
    rows: np.ndarray  # plan entries that sample a token
    seq_ids: np.ndarray  # int64, their request ids
    next_pos: np.ndarray  # int32, the position each sampled token will take
    reqs: list[Request | None]  # their requests (None: not live when launched)
    logits: torch.Tensor  # [R, V] on the device
    argmax: torch.Tensor | None  # [R] on the device when any row samples greedily
    host: torch.Tensor | None = None  # the argmax's pinned copy (CUDA)
    ready: torch.cuda.Event | None = None  # recorded after that copy
    # what the step computes, for benchmarks: entries, prefill entries, KV tokens, new tokens
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    # the scheduler already applied this step with placeholder tokens; these finished then
    speculative: bool = False
    finished: list = field(default_factory=list)


class TokenReadback:
    """Two pinned int64 buffers of `rows` tokens, used in turn (CUDA); copies otherwise."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._bufs = [
            torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(2 * self._cuda)
        ]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def start(self, step: Launched) -> None:
        """Queue the copy of step.argmax to the host (after the step's kernels). NOTE: a copy
        on the CPU too: a captured graph's argmax is its static output, which the next step,
        launched before this one is read, overwrites."""
        if step.argmax is None:
            return
        if not self._cuda:
            step.host = step.argmax.clone()
            return
        i, self._next = self._next, 1 - self._next
        if self._events[i] is not None:
            self._events[i].synchronize()  # NOTE: read two steps ago; normally long done
        n = step.argmax.shape[0]
        step.host = self._bufs[i][:n]
        step.host.copy_(step.argmax, non_blocking=True)
        step.ready = self._events[i] = recorded_event(step.argmax.device)

    @staticmethod
    def tokens(step: Launched) -> list[int]:
        """The step's argmax as ints (waits for the device)."""
        if step.ready is not None:
            step.ready.synchronize()
        return step.host.tolist()


def chained_rows(plan, prev: Launched) -> np.ndarray | None:
    """For a plan whose decodes (its trailing entries, one token each) all continue
    sequences that sampled in `prev`, and whose prefill entries read none of `prev`'s
    tokens: the row of `prev` whose token is each decode's input. None otherwise."""
    nd = plan.num_seqs - plan.num_prefill
    if not nd or not len(prev.seq_ids):
        return None
    ids = np.asarray(plan.seq_ids)
    if plan.num_prefill and np.isin(ids[: plan.num_prefill], prev.seq_ids).any():
        return None  # e.g. a preempted sequence recomputing its tokens
    dec = ids[plan.num_prefill :]
    order = np.argsort(prev.seq_ids, kind="stable")
    pos = np.searchsorted(prev.seq_ids, dec, sorter=order)
    src = order[np.minimum(pos, len(order) - 1)]
    if not np.array_equal(prev.seq_ids[src], dec):
        return None
    # each decode's input is the token its sequence sampled last step
    if not np.array_equal(np.asarray(plan.positions)[-nd:], prev.next_pos[src]):
        return None
    return src


def reads_tokens_of(plan, prev: Launched) -> bool:
    """Whether any entry of `plan` reads a token `prev` sampled (still a placeholder)."""
    return bool(len(prev.seq_ids)) and bool(np.isin(np.asarray(plan.seq_ids), prev.seq_ids).any())


def patch_inputs(plan, prev: Launched, toks: list[int]) -> None:
    """Write `prev`'s sampled tokens into `plan`'s input ids where it reads them."""
    pos_tok = zip(prev.next_pos.tolist(), toks, strict=True)
    where = dict(zip(prev.seq_ids.tolist(), pos_tok, strict=True))
    ids, qsl = plan.input_ids, np.asarray(plan.query_start_loc)
    start, n = np.asarray(plan.num_computed), np.asarray(plan.num_new_tokens)
    for j, sid in enumerate(np.asarray(plan.seq_ids).tolist()):
        hit = where.get(sid)
        if hit is not None and start[j] <= hit[0] < start[j] + n[j]:
            ids[qsl[j] + hit[0] - start[j]] = hit[1]
