"""Plain-Python model of the scheduler rules (the C++ core's reference).

It mirrors runtime/csrc rule for rule -- block allocation order, LRU eviction, the prefix match
(verified by parent block and generation), admission, chunked prefill, preemption and finishing
-- so for the same calls it yields the same plans, block ids included. Prefix keys are exact
(interned (parent key, block tokens) pairs), so the model never has a hash collision.

Used by the stateful property tests and by scripts/bench_scheduler.py as the plain-Python
implementation of the same plan.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

NONE, LENGTH = 0, 3


class ModelBlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, prefix_reuse: bool) -> None:
        self.num_blocks, self.tpb, self.prefix_reuse = num_blocks, tokens_per_block, prefix_reuse
        self.ref = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks  # None: not cached
        self.parent = [-1] * num_blocks
        self.parent_gen = [0] * num_blocks
        self.gen = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable cached blocks, oldest first
        self.map: dict[int, int] = {}  # key -> block
        self._intern: dict[tuple, int] = {}
        self.hit_blocks = self.miss_blocks = self.hit_tokens = 0

    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    def blocks_for(self, n: int) -> int:
        return -(-n // self.tpb)

    def _key(self, prev: int, blk: list[int]) -> int:
        return self._intern.setdefault((prev, tuple(blk)), len(self._intern) + 1)

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], int]:
        if not self.prefix_reuse or len(tokens) <= 1:
            return [], 0
        out, evictable, key, parent = [], 0, 0, -1
        for i in range((len(tokens) - 1) // self.tpb):
            key = self._key(key, tokens[i * self.tpb : (i + 1) * self.tpb])
            b = self.map.get(key)
            if b is None or self.parent[b] != parent:
                break
            if parent >= 0 and self.parent_gen[b] != self.gen[parent]:
                break
            out.append(b)
            evictable += self.ref[b] == 0
            parent = b
        return out, evictable

    def record_match(self, hits: int, eligible: int) -> None:
        self.hit_blocks += hits
        self.miss_blocks += eligible - hits
        self.hit_tokens += hits * self.tpb

    def _alloc(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.lru.popitem(last=False)
            del self.map[self.key[b]]
            self.key[b] = None
        self.gen[b] += 1
        self.parent[b] = -1
        self.ref[b] = 1
        return b

    def can_grow(self, table: list[int], n: int) -> bool:
        return self.blocks_for(n) - len(table) <= self.num_free()

    def grow(self, table: list[int], n: int) -> None:
        for _ in range(self.blocks_for(n) - len(table)):
            table.append(self._alloc())

    def share(self, seq: ModelSeq, matched: list[int]) -> None:
        for b in matched:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1
            seq.table.append(b)
        seq.num_hashed = len(matched)
        seq.last_key = self.key[matched[-1]] if matched else 0

    def mark_computed(self, seq: ModelSeq) -> None:
        if not self.prefix_reuse:
            return
        if seq.num_hashed == 0:
            seq.last_key = 0
        tpb, table = self.tpb, seq.table
        for i in range(seq.num_hashed, seq.num_computed // tpb):
            key = self._key(seq.last_key, seq.tokens[i * tpb : (i + 1) * tpb])
            b = table[i]
            if self.key[b] is None and key not in self.map:
                self.map[key] = b
                self.key[b] = key
                p = table[i - 1] if i > 0 else -1
                self.parent[b] = p
                self.parent_gen[b] = self.gen[p] if p >= 0 else 0
            seq.last_key = key
            seq.num_hashed = i + 1

    def release(self, seq: ModelSeq) -> None:
        for b in reversed(seq.table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is not None:
                    self.lru[b] = None
                else:
                    self.free.append(b)
        seq.table.clear()
        seq.num_hashed, seq.last_key = 0, 0


@dataclass(eq=False)
class ModelSeq:
    id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    max_len: int
    reserve_blocks: int
    num_computed: int = 0
    prefilled: bool = False
    running: bool = False
    table: list[int] = field(default_factory=list)
    num_hashed: int = 0
    last_key: int = 0


class ModelScheduler:
    """Same contract as ingot.runtime.scheduler.Scheduler, in plain Python.

    `schedule()` returns a dict with the StepPlan's array fields (plus num_seqs, num_tokens,
    num_prefill, preempted); `update()` returns the finished (req_id, reason int) pairs.
    Refused requests raise ValueError here (the wrapper's RequestError is a user error type).
    """

    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        max_batch_size: int,
        max_num_tokens: int,
        max_seq_len: int,
        policy: str,
        enable_prefix_reuse: bool = True,
    ) -> None:
        self.bm = ModelBlockManager(num_blocks, tokens_per_block, enable_prefix_reuse)
        self.tpb, self.max_batch_size = tokens_per_block, max_batch_size
        self.max_num_tokens, self.max_seq_len = max_num_tokens, max_seq_len
        self.no_evict = policy == "guaranteed_no_evict"
        self.max_blocks = -(-max_seq_len // tokens_per_block)
        self.seqs: dict[int, ModelSeq] = {}
        self.waiting: deque[ModelSeq] = deque()
        self.running: list[ModelSeq] = []
        self.plan: list[tuple[ModelSeq | None, int, bool]] = []
        self.num_preemptions = 0

    def add_request(self, req_id: int, prompt: list[int], max_new_tokens: int) -> None:
        n, nb = len(prompt), self.bm.num_blocks
        if req_id in self.seqs:
            raise ValueError(f"duplicate request id {req_id}")
        if n >= self.max_seq_len or self.bm.blocks_for(n) > nb:
            raise ValueError(f"request {req_id}: prompt length {n} refused")
        want = min(n + max_new_tokens, self.max_seq_len)
        seq = ModelSeq(
            req_id,
            [int(t) for t in prompt],
            n,
            max_new_tokens,
            min(want, max(nb * self.tpb, n)),
            min(self.bm.blocks_for(want), nb),
        )
        self.seqs[req_id] = seq
        self.waiting.append(seq)

    def cancel(self, req_id: int) -> bool:
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return False
        (self.running if seq.running else self.waiting).remove(seq)
        self.plan = [(None, n, s) if e is seq else (e, n, s) for e, n, s in self.plan]
        self.bm.release(seq)
        seq.running = False
        return True

    def _preempt(self, seq: ModelSeq, preempted: list[int]) -> None:
        self.bm.release(seq)
        seq.num_computed, seq.prefilled, seq.running = 0, False, False
        self.waiting.appendleft(seq)
        preempted.append(seq.id)
        self.num_preemptions += 1

    def schedule(self) -> dict:
        bm, budget, prefill, decode, preempted = self.bm, self.max_num_tokens, [], [], []
        i = 0
        while i < len(self.running) and budget > 0:
            s = self.running[i]
            n = min(len(s.tokens) - s.num_computed, budget)
            target, self_preempted = s.num_computed + n, False
            while not bm.can_grow(s.table, target) and not self.no_evict:
                victim = self.running.pop()
                self._preempt(victim, preempted)
                if victim is s:
                    self_preempted = True
                    break
            if self_preempted:
                break
            if bm.can_grow(s.table, target):
                bm.grow(s.table, target)
                (decode if s.prefilled else prefill).append((s, n))
                budget -= n
            i += 1
        promised = 0
        if self.no_evict and self.waiting:
            promised = sum(max(0, r.reserve_blocks - len(r.table)) for r in self.running)
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_batch_size
        ):
            s = self.waiting[0]
            matched, evictable = bm.match_prefix(s.tokens)
            computed = len(matched) * self.tpb
            n = min(len(s.tokens) - computed, budget)
            avail = bm.num_free() - evictable
            if self.no_evict:
                if avail < s.reserve_blocks - len(matched) + promised:
                    break
            elif avail < bm.blocks_for(computed + n) - len(matched):
                break
            self.waiting.popleft()
            bm.record_match(len(matched), (len(s.tokens) - 1) // self.tpb if bm.prefix_reuse else 0)
            bm.share(s, matched)
            bm.grow(s.table, computed + n)
            s.num_computed, s.running = computed, True
            self.running.append(s)
            prefill.append((s, n))
            budget -= n
            if self.no_evict:
                promised += s.reserve_blocks - len(s.table)
        return self._fill(prefill, decode, preempted)

    def _fill(self, prefill: list, decode: list, preempted: list[int]) -> dict:
        entries = prefill + decode
        B, tpb = len(entries), self.tpb
        ids, new, comp, ctx, samples, qsl = [], [], [], [], [], [0]
        inp, pos, slots = [], [], []
        tables = np.zeros((B, self.max_blocks), np.int32)
        self.plan = []
        for k, (s, n) in enumerate(entries):
            nc = s.num_computed
            sample = nc + n == len(s.tokens)
            self.plan.append((s, n, sample))
            ids.append(s.id)
            new.append(n)
            comp.append(nc)
            ctx.append(nc + n)
            qsl.append(qsl[-1] + n)
            samples.append(sample)
            inp.extend(s.tokens[nc : nc + n])
            for p in range(nc, nc + n):
                pos.append(p)
                slots.append(s.table[p // tpb] * tpb + p % tpb)
            tables[k, : len(s.table)] = s.table
        i32 = np.int32
        return {
            "num_seqs": B,
            "num_tokens": len(inp),
            "num_prefill": len(prefill),
            "seq_ids": np.array(ids, np.int64),
            "num_new_tokens": np.array(new, i32),
            "num_computed": np.array(comp, i32),
            "context_lens": np.array(ctx, i32),
            "query_start_loc": np.array(qsl, i32),
            "samples": np.array(samples, bool),
            "input_ids": np.array(inp, i32),
            "positions": np.array(pos, i32),
            "slot_mapping": np.array(slots, i32),
            "block_tables": tables,
            "preempted": preempted,
        }

    def update(self, new_tokens, finish) -> list[tuple[int, int]]:
        finished = []
        for k, (s, n, sample) in enumerate(self.plan):
            if s is None:
                continue
            s.num_computed += n
            self.bm.mark_computed(s)
            if not sample:
                continue
            s.tokens.append(int(new_tokens[k]))
            s.prefilled = True
            reason = int(finish[k])
            if reason == NONE and (
                len(s.tokens) - s.prompt_len >= s.max_new_tokens or len(s.tokens) >= s.max_len
            ):
                reason = LENGTH
            if reason != NONE:
                self.bm.release(s)
                s.running = False
                finished.append((s.id, reason))
                del self.seqs[s.id]
        if finished:
            self.running = [r for r in self.running if r.running]
        self.plan = []
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)


def fake_next_token(tokens, vocab: int = 97) -> int:
    """Deterministic fake model: the next token is a hash of the whole sequence so far."""
    h = 1469598103934665603
    for t in tokens:
        h = ((h ^ int(t)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h % vocab
