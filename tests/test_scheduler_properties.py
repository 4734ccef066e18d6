"""Stateful property tests: random add / step / finish / cancel / preempt sequences.

The C++ scheduler runs beside tests/sched_model.py (the plain-Python model of the rules) and
must produce identical plans and finishes. After every step: the core's integrity check,
refcounts == owners, a shadow map of block slot -> token prefix written there shows that every
attended KV slot (prefix hits included) holds exactly the sequence's own prefix, new KV goes
only to unshared blocks, and finished requests carry the tokens the fake model gives alone.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from sched_model import ModelScheduler, fake_next_token

from ingot.runtime.errors import RequestError
from ingot.runtime.scheduler import Scheduler, SchedulerConfig
from ingot.runtime.types import FinishReason

FIELDS = (
    "seq_ids",
    "num_new_tokens",
    "num_computed",
    "context_lens",
    "query_start_loc",
    "samples",
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
)
VOCAB = 3  # tiny vocab + shared stems: many prefix hits and repeated blocks
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0, 2, 2], [1, 0, 1, 0, 1, 0, 1, 0]]


class SchedulerMachine(RuleBasedStateMachine):
    hash_bits = 64
    compare_model = True

    @initialize(
        num_blocks=st.integers(4, 16),
        tpb=st.sampled_from([1, 2, 4]),
        batch=st.integers(1, 4),
        max_tokens=st.integers(1, 16),
        seq_len=st.integers(10, 48),
        policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
        reuse=st.booleans(),
    )
    def setup(self, num_blocks, tpb, batch, max_tokens, seq_len, policy, reuse):
        self.cfg = SchedulerConfig(
            num_blocks=num_blocks,
            tokens_per_block=tpb,
            max_batch_size=batch,
            max_num_tokens=max_tokens,
            max_seq_len=seq_len,
            policy=policy,
            enable_prefix_reuse=reuse,
        )
        self.s = Scheduler(self.cfg, _hash_bits=self.hash_bits)
        self.m = ModelScheduler(num_blocks, tpb, batch, max_tokens, seq_len, policy, reuse)
        self.next_id = 0
        self.live: dict[int, tuple[list[int], int]] = {}  # id -> (prompt, max_new_tokens)
        self.shadow: dict[int, tuple[int, ...]] = {}  # KV slot -> token prefix written there
        self.idle_steps = 0

    @rule(
        reqs=st.lists(
            st.tuples(
                st.integers(0, 3),
                st.integers(0, 8),
                st.lists(st.integers(0, VOCAB - 1), max_size=6),
                st.integers(1, 8),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, reqs):
        for stem, cut, tail, max_new in reqs:
            self._add((STEMS[stem][:cut] if stem < 3 else []) + tail, max_new)

    def _add(self, prompt, max_new):
        rid, self.next_id = self.next_id, self.next_id + 1
        try:
            self.s.add_request(rid, prompt, max_new)
        except (RequestError, ValueError):
            too_long = len(prompt) >= self.cfg.max_seq_len
            too_big = -(-len(prompt) // self.cfg.tokens_per_block) > self.cfg.num_blocks
            assert not prompt or too_long or too_big
            return
        self.m.add_request(rid, prompt, max_new)
        self.live[rid] = (prompt, max_new)

    @rule(data=st.data(), really=st.integers(0, 3))
    def cancel(self, data, really):
        if really:  # cancels are one rule in three; keep most requests alive
            return
        rid = data.draw(st.sampled_from(sorted(self.live) + [10**9]))
        assert self.s.cancel(rid) == self.m.cancel(rid) == (rid != 10**9)
        self.live.pop(rid, None)

    @rule(
        data=st.data(),
        steps=st.integers(1, 6),
        eos=st.integers(0, 5),
        cancel_in_flight=st.integers(0, 9),
    )
    def step(self, data, steps, eos, cancel_in_flight):
        for k in range(steps):
            self._step(data, eos, cancel_in_flight == 0 and k == 0)
            self.integrity()

    def _step(self, data, eos, cancel_in_flight):
        plan = self.s.schedule()
        if self.compare_model:
            ref = self.m.schedule()
            assert (plan.num_seqs, plan.num_tokens, plan.num_prefill) == (
                ref["num_seqs"],
                ref["num_tokens"],
                ref["num_prefill"],
            )
            for f in FIELDS:
                assert np.array_equal(getattr(plan, f), ref[f]), f
            assert plan.preempted == ref["preempted"]
        for rid in plan.preempted:
            assert rid in self.live
        self.idle_steps = 0 if plan.num_seqs else self.idle_steps + 1
        assert plan.num_seqs or not self.s.has_unfinished() or self.idle_steps < 2, "stuck"
        self._check_and_write(plan)
        new = np.zeros(plan.num_seqs, np.int32)
        fin = np.zeros(plan.num_seqs, np.int8)
        for i, rid in enumerate(plan.seq_ids.tolist()):
            if plan.samples[i]:
                new[i] = fake_next_token(self.s.tokens(rid), VOCAB)
                fin[i] = FinishReason.EOS if (rid + eos) % 7 == 0 else 0
        if cancel_in_flight and plan.num_seqs:
            rid = int(plan.seq_ids[data.draw(st.integers(0, plan.num_seqs - 1))])
            assert self.s.cancel(rid) and self.m.cancel(rid)
            self.live.pop(rid)
            self.s.check_integrity()
        done = self.s.update(new, fin)
        if self.compare_model:
            assert [(r, int(x)) for r, x in done] == self.m.update(new, fin)
        for rid, reason in done:
            prompt, max_new = self.live.pop(rid)
            got = self.s.tokens(rid).tolist()
            want = list(prompt)
            while len(want) < len(got):
                want.append(fake_next_token(want, VOCAB))
            assert got == want, "tokens depend on scheduling"
            n_new = len(got) - len(prompt)
            if reason == FinishReason.LENGTH:
                limit = min(self.cfg.max_seq_len, self.cfg.num_blocks * self.cfg.tokens_per_block)
                assert n_new == max_new or len(got) >= min(limit, len(prompt) + max_new)
            else:
                assert reason == FinishReason.EOS and 1 <= n_new <= max_new

    def _check_and_write(self, plan):
        tpb = self.cfg.tokens_per_block
        for i, rid in enumerate(plan.seq_ids.tolist()):
            toks = self.s.tokens(rid).tolist()
            table = plan.block_tables[i]
            nc, ctx = int(plan.num_computed[i]), int(plan.context_lens[i])
            assert ctx <= len(toks)
            for p in range(nc):  # attended KV must be this sequence's own prefix
                slot = int(table[p // tpb]) * tpb + p % tpb
                assert self.shadow.get(slot) == tuple(toks[: p + 1]), (rid, p)
            lo = int(plan.query_start_loc[i])
            for j in range(ctx - nc):
                p = nc + j
                slot = int(plan.slot_mapping[lo + j])
                assert slot == int(table[p // tpb]) * tpb + p % tpb
                assert self.s.ref_count(slot // tpb) == 1, "new KV written into a shared block"
                assert int(plan.positions[lo + j]) == p and int(plan.input_ids[lo + j]) == toks[p]
                self.shadow[slot] = tuple(toks[: p + 1])

    @invariant()
    def integrity(self):
        if hasattr(self, "s"):
            self.s.check_integrity()
            st_ = self.s.stats()
            assert st_["used_blocks"] + st_["cached_blocks"] + st_["free_blocks"] == (
                self.cfg.num_blocks
            )
            assert self.s.num_free_blocks() == st_["cached_blocks"] + st_["free_blocks"]
            assert st_["num_running"] + st_["num_waiting"] == len(self.live)
            assert self.s.has_unfinished() == bool(self.live)
            if self.compare_model:
                assert st_["num_preemptions"] == self.m.num_preemptions
                assert st_["prefix_hit_blocks"] == self.m.bm.hit_blocks
                assert self.s.num_free_blocks() == self.m.bm.num_free()


class CollidingHashMachine(SchedulerMachine):
    """Block hashes truncated to 2 bits: collisions everywhere must never cause wrong reuse."""

    hash_bits = 2
    compare_model = False


_settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = _settings
TestCollidingHashes = CollidingHashMachine.TestCase
TestCollidingHashes.settings = settings(_settings, max_examples=80)
