"""Unit tests of ingot.runtime.scheduler.Scheduler: every call, bad input, both policies."""

from __future__ import annotations

import numpy as np
import pytest
from sched_model import fake_next_token

from ingot.runtime.errors import RequestError
from ingot.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan
from ingot.runtime.types import FinishReason


def cfg(**kw) -> SchedulerConfig:
    base = dict(
        num_blocks=64,
        tokens_per_block=4,
        max_batch_size=8,
        max_num_tokens=64,
        max_seq_len=64,
        policy="max_utilization",
    )
    base.update(kw)
    return SchedulerConfig(**base)


def step(s: Scheduler, eos: set[int] = frozenset()) -> tuple[StepPlan, list]:
    """One step with the fake model; request ids in `eos` finish with EOS when they sample."""
    plan = s.schedule()
    new = np.zeros(plan.num_seqs, np.int32)
    fin = np.zeros(plan.num_seqs, np.int8)
    for i, (rid, smp) in enumerate(zip(plan.seq_ids.tolist(), plan.samples.tolist(), strict=True)):
        if smp:
            new[i] = fake_next_token(s.tokens(rid))
            fin[i] = FinishReason.EOS if rid in eos else 0
    done = s.update(new, fin)
    s.check_integrity()
    return plan, done


def run(s: Scheduler, max_steps: int = 10_000) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            return out
        _, done = step(s)
        for rid, reason in done:
            assert reason == FinishReason.LENGTH
            out[rid] = s.tokens(rid).tolist()
    raise AssertionError("scheduler did not drain")


def expected(prompt: list[int], n: int) -> list[int]:
    t = list(prompt)
    for _ in range(n):
        t.append(fake_next_token(t))
    return t


@pytest.mark.parametrize(
    "field", ["num_blocks", "tokens_per_block", "max_batch_size", "max_num_tokens", "max_seq_len"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_config_rejects_bad_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


def test_config_rejects_unknown_policy_and_is_frozen():
    with pytest.raises(ValueError, match="policy"):
        cfg(policy="fifo")
    c = cfg(max_seq_len=66, tokens_per_block=4)
    assert c.max_blocks_per_seq == 17
    with pytest.raises(AttributeError):
        c.num_blocks = 3  # type: ignore[misc]


def test_empty_schedule():
    s = Scheduler(cfg())
    plan = s.schedule()
    assert plan.num_seqs == 0 and plan.num_tokens == 0 and plan.seq_ids.shape == (0,)
    assert plan.query_start_loc.tolist() == [0] and not s.has_unfinished()
    assert s.update(np.zeros(0, np.int32), np.zeros(0, np.int8)) == []


def test_plan_contents_prefill_then_decode():
    s = Scheduler(cfg(max_seq_len=16))
    s.add_request(7, [5, 6, 7, 8, 9, 10], max_new_tokens=4)
    plan = s.schedule()
    assert (plan.num_seqs, plan.num_tokens, plan.num_prefill) == (1, 6, 1)
    assert plan.seq_ids.dtype == np.int64 and plan.seq_ids.tolist() == [7]
    assert plan.num_new_tokens.tolist() == [6] and plan.num_computed.tolist() == [0]
    assert plan.context_lens.tolist() == [6] and plan.query_start_loc.tolist() == [0, 6]
    assert plan.samples.tolist() == [True]
    assert plan.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert plan.positions.tolist() == list(range(6))
    assert plan.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5]  # blocks 0, 1
    assert plan.block_tables.shape == (1, 4) and plan.block_tables.tolist() == [[0, 1, 0, 0]]
    for name in ("num_new_tokens", "input_ids", "slot_mapping", "block_tables"):
        arr = getattr(plan, name)
        assert arr.dtype == np.int32 and not arr.flags.owndata  # views of C++ buffers
    assert s.update(np.array([42], np.int32), np.array([0], np.int8)) == []
    assert s.tokens(7).tolist() == [5, 6, 7, 8, 9, 10, 42]
    plan = s.schedule()
    assert (plan.num_seqs, plan.num_tokens, plan.num_prefill) == (1, 1, 0)
    assert plan.num_computed.tolist() == [6] and plan.input_ids.tolist() == [42]
    assert plan.slot_mapping.tolist() == [6] and plan.samples.tolist() == [True]
    s.update(np.array([43], np.int32), np.array([0], np.int8))
    plan = s.schedule()
    assert plan.slot_mapping.tolist() == [7] and plan.block_tables.tolist() == [[0, 1, 0, 0]]
    s.update(np.array([44], np.int32), np.array([0], np.int8))
    plan = s.schedule()
    assert plan.slot_mapping.tolist() == [8]  # a new block (2) for position 8
    assert plan.block_tables.tolist() == [[0, 1, 2, 0]]
    done = s.update(np.array([45], np.int32), np.array([0], np.int8))
    assert done == [(7, FinishReason.LENGTH)] and isinstance(done[0][1], FinishReason)
    assert s.tokens(7).tolist() == [5, 6, 7, 8, 9, 10, 42, 43, 44, 45]  # until the next update
    assert not s.has_unfinished() and s.stats()["used_blocks"] == 0
    s.check_integrity()


def test_chunked_prefill_and_prefill_before_decode():
    s = Scheduler(cfg(max_num_tokens=5))
    s.add_request(1, list(range(3)), 5)
    step(s)  # request 1 prefilled in one step
    s.add_request(2, list(range(100, 112)), 2)
    plan, _ = step(s)
    # 1 decodes; 2 gets the other 4 tokens of the budget. Prefill entries come first.
    assert plan.seq_ids.tolist() == [2, 1] and plan.num_prefill == 1
    assert plan.num_new_tokens.tolist() == [4, 1] and plan.samples.tolist() == [False, True]
    assert plan.query_start_loc.tolist() == [0, 4, 5]
    plan, _ = step(s)
    assert plan.seq_ids.tolist() == [2, 1] and plan.num_computed.tolist() == [4, 4]
    plan, _ = step(s)
    assert plan.num_new_tokens.tolist() == [4, 1] and plan.samples.tolist() == [True, True]
    assert run(s) == {1: expected(range(3), 5), 2: expected(range(100, 112), 2)}


def test_max_batch_size_limits_running():
    s = Scheduler(cfg(max_batch_size=2))
    for i in range(4):
        s.add_request(i, [i, i + 1], 3)
    plan, _ = step(s)
    assert plan.seq_ids.tolist() == [0, 1] and s.stats()["num_waiting"] == 2
    assert run(s) == {i: expected([i, i + 1], 3) for i in range(4)}


def test_length_at_max_seq_len_and_eos():
    s = Scheduler(cfg(max_seq_len=8))
    s.add_request(1, list(range(6)), 100)
    s.add_request(2, list(range(3)), 100)
    _, done = step(s, eos={2})
    assert done == [(2, FinishReason.EOS)] and len(s.tokens(2)) == 4
    _, done = step(s)
    assert done == [(1, FinishReason.LENGTH)] and len(s.tokens(1)) == 8


def test_bad_requests_are_refused_and_others_go_on():
    s = Scheduler(cfg(num_blocks=4, max_seq_len=32))
    s.add_request(1, [1, 2, 3], 2)
    before = s.stats()
    with pytest.raises(RequestError, match=r"request 5: prompt length 32 .*max_seq_len 32"):
        s.add_request(5, list(range(32)), 1)
    with pytest.raises(RequestError, match=r"request 6: prompt length 17 needs 5 KV blocks.* 4"):
        s.add_request(6, list(range(17)), 1)
    with pytest.raises(ValueError, match="duplicate request id 1"):
        s.add_request(1, [1], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add_request(8, [1], 0)
    with pytest.raises(ValueError, match="empty"):
        s.add_request(9, [], 1)
    assert s.stats() == before
    s.add_request(6, list(range(16)), 1)  # exactly the pool: accepted
    assert run(s) == {1: expected([1, 2, 3], 2), 6: expected(range(16), 1)}


def test_update_misuse():
    s = Scheduler(cfg())
    with pytest.raises(RuntimeError):
        s.update(np.zeros(1, np.int32), np.zeros(1, np.int8))
    s.add_request(1, [1, 2], 2)
    s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    with pytest.raises(ValueError):
        s.update(np.zeros(2, np.int32), np.zeros(2, np.int8))
    with pytest.raises(ValueError, match="finish reason"):
        s.update(np.zeros(1, np.int32), np.array([9], np.int8))
    s.update([3], [0])  # lists are converted
    assert s.tokens(1).tolist() == [1, 2, 3]
    with pytest.raises(KeyError):
        s.tokens(99)


@pytest.mark.parametrize("where", ["waiting", "running", "mid_prefill", "in_flight"])
def test_cancel_frees_everything(where):
    s = Scheduler(cfg(max_num_tokens=4, max_batch_size=1))
    s.add_request(1, list(range(10)), 5)
    s.add_request(2, [7, 8], 2)
    if where != "waiting":
        step(s)  # 1 prefilled 4 of 10 tokens
    if where == "running":
        step(s), step(s)
    if where == "in_flight":
        plan = s.schedule()
        assert s.cancel(1)
        s.check_integrity()
        assert s.update(np.zeros(plan.num_seqs, np.int32), np.zeros(plan.num_seqs, np.int8)) == []
    else:
        assert s.cancel(1 if where != "waiting" else 2)
    assert not s.cancel(1 if where != "waiting" else 2) and not s.cancel(12345)
    s.check_integrity()
    out = run(s)
    assert list(out) == ([1] if where == "waiting" else [2])
    assert s.stats()["used_blocks"] == 0 and s.num_free_blocks() == 64


def test_guaranteed_no_evict_admits_only_what_fits():
    s = Scheduler(cfg(num_blocks=6, policy="guaranteed_no_evict"))
    s.add_request(1, list(range(10)), 10)  # whole KV: 20 tokens = 5 blocks
    s.add_request(2, list(range(50, 54)), 4)  # 2 blocks: must wait for 1
    plan, _ = step(s)
    assert plan.seq_ids.tolist() == [1] and s.stats()["num_waiting"] == 1
    while 1 in (p := step(s)[0]).seq_ids.tolist() and p.num_seqs == 1:
        assert s.stats()["num_waiting"] == 1 or not s.has_unfinished()
    out = run(s)
    assert s.stats()["num_preemptions"] == 0
    assert out.get(2) == expected(range(50, 54), 4)


def test_max_utilization_small_pool_matches_big_pool():
    rng = np.random.default_rng(0)
    reqs = [
        (i, rng.integers(0, 50, rng.integers(3, 40)).tolist(), int(rng.integers(1, 30)))
        for i in range(14)
    ]
    results = {}
    # 18 blocks (72 tokens) hold the longest request alone, far from all of them at once.
    assert max(len(p) + n for _, p, n in reqs) <= 72
    for num_blocks in (200, 18):
        s = Scheduler(cfg(num_blocks=num_blocks, max_batch_size=6, max_num_tokens=32))
        for rid, prompt, n in reqs:
            s.add_request(rid, prompt, n)
        results[num_blocks] = run(s)
        if num_blocks == 18:
            assert s.stats()["num_preemptions"] > 0
    assert results[18] == results[200] == {r: expected(p, n) for r, p, n in reqs}


def test_preemption_requeues_most_recent_with_its_tokens():
    s = Scheduler(cfg(num_blocks=4, tokens_per_block=2, max_seq_len=32))
    s.add_request(1, [1, 2, 3], 5)
    s.add_request(2, [4, 5, 6], 5)
    step(s)  # both admitted: 2 blocks each
    preempted = []
    for _ in range(3):
        plan, _ = step(s)
        preempted += plan.preempted
    assert preempted == [2] and s.stats()["num_preemptions"] == 1
    assert len(s.tokens(2)) > 3  # kept the tokens it generated
    assert run(s) == {1: expected([1, 2, 3], 5), 2: expected([4, 5, 6], 5)}


@pytest.mark.parametrize("reuse", [True, False])
def test_prefix_reuse_across_requests(reuse):
    s = Scheduler(cfg(enable_prefix_reuse=reuse))
    system = list(range(20, 32))  # 3 full blocks
    s.add_request(1, system + [1, 2], 3)
    run(s)
    assert s.stats()["cached_blocks"] == (4 if reuse else 0)  # 3 prompt + 1 decode-filled
    s.add_request(2, system + [9], 2)
    plan, _ = step(s)
    st = s.stats()
    if reuse:
        assert plan.num_computed.tolist() == [12] and plan.num_new_tokens.tolist() == [1]
        assert st["prefix_hit_blocks"] == 3 and st["prefix_hit_tokens"] == 12
        assert st["prefix_miss_blocks"] == 3  # request 1 missed all three
    else:
        assert plan.num_computed.tolist() == [0] and st["prefix_hit_blocks"] == 0
    # The whole previous sequence (incl. decoded tokens) as a prompt reuses 4 blocks.
    s.add_request(3, expected(system + [1, 2], 3) + [5], 1)
    plan, _ = step(s)
    assert plan.num_computed.tolist()[0] == (16 if reuse else 0)
    run(s)
