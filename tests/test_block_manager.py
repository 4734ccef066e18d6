"""Unit tests of the standalone paged KV block manager (ingot.runtime._core via scheduler)."""

from __future__ import annotations

import numpy as np
import pytest

from ingot.runtime.scheduler import BlockManager


def toks(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def ok(bm: BlockManager) -> None:
    msg = bm.check_integrity()
    assert msg == "", msg


@pytest.mark.parametrize(
    "args,name", [((0, 4), "num_blocks"), ((-1, 4), "num_blocks"), ((4, 0), "tokens_per_block")]
)
def test_invalid_sizes_name_the_parameter(args, name):
    with pytest.raises(ValueError, match=name):
        BlockManager(*args)


def test_allocate_append_free_and_refcounts():
    bm = BlockManager(8, 4)
    assert bm.num_free_blocks() == 8 and bm.num_blocks == 8 and bm.tokens_per_block == 4
    assert bm.can_allocate(1, toks(*range(10)))
    assert bm.allocate(1, toks(*range(10))) == 0  # nothing cached yet
    table = bm.block_table(1)
    assert table.dtype == np.int32 and table.tolist() == [0, 1, 2]
    assert not table.flags.owndata  # a view over C++ memory
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks() == 5 and bm.num_used_blocks() == 3
    assert bm.can_append(1, 12) and bm.can_append(1, 13)
    bm.append(1, 13)
    assert bm.block_table(1).tolist() == [0, 1, 2, 3]
    ok(bm)
    assert bm.free(1) and not bm.free(1)
    assert bm.num_free_blocks() == 8 and bm.ref_count(0) == 0
    ok(bm)
    with pytest.raises(KeyError):
        bm.block_table(1)
    with pytest.raises(IndexError):
        bm.ref_count(8)


def test_check_then_commit_refuses_when_full():
    bm = BlockManager(3, 4)
    bm.allocate(1, toks(*range(8)))
    assert not bm.can_allocate(2, toks(*range(100, 106)))
    with pytest.raises(RuntimeError):
        bm.allocate(2, toks(*range(100, 106)))
    assert not bm.can_append(1, 13)
    with pytest.raises(RuntimeError):
        bm.append(1, 13)
    with pytest.raises(ValueError):
        bm.allocate(1, toks(1))  # already allocated
    ok(bm)


def test_prefix_reuse_caps_at_len_minus_one_and_counts():
    bm = BlockManager(8, 4)
    prompt = toks(*range(10))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 10)  # blocks 0, 1 full and hashed
    bm.free(1)
    assert bm.num_cached_blocks() == 2 and bm.num_free_blocks() == 8
    ok(bm)
    assert bm.allocate(2, prompt) == 8  # two full blocks reused, the rest computed
    assert bm.block_table(2).tolist()[:2] == [0, 1]
    # Exactly 8 tokens: never reuse the whole prompt, only (8 - 1) // 4 = 1 block.
    assert bm.allocate(3, prompt[:8]) == 4
    assert bm.ref_count(0) == 2 and bm.ref_count(1) == 1
    st = bm.stats()
    assert st["prefix_hit_blocks"] == 3 and st["prefix_hit_tokens"] == 12
    assert st["prefix_miss_blocks"] == 2  # the first allocation missed both blocks
    ok(bm)
    # A different first block breaks the chain even if the second block's tokens match.
    other = prompt.copy()
    other[0] = 99
    assert bm.allocate(4, other) == 0
    ok(bm)


def test_decode_filled_blocks_are_cached():
    bm = BlockManager(8, 4)
    seq = toks(*range(6))
    bm.allocate(1, seq)
    bm.mark_computed(1, seq, 6)
    seq = toks(*range(9))  # decode appended tokens 6, 7, 8
    bm.append(1, 9)
    bm.mark_computed(1, seq, 8)  # block 1 became full during decode
    bm.free(1)
    assert bm.allocate(2, toks(*range(9), 50)) == 8


def test_lru_eviction_keeps_prefix_heads_longest():
    bm = BlockManager(4, 2)
    a = toks(1, 2, 3, 4, 5)
    bm.allocate(1, a)
    bm.mark_computed(1, a, 5)
    bm.free(1)  # blocks 0, 1 cached; 2 free
    assert bm.num_cached_blocks() == 2
    bm.allocate(2, toks(*range(100, 106)))  # needs 3 blocks: 2 free + evicts the LRU one
    assert bm.num_cached_blocks() == 1
    ok(bm)
    bm.free(2)
    # The chain head (block 0) survived: the first block of `a` is still reusable.
    assert bm.allocate(3, a[:3]) == 2 and bm.block_table(3).tolist()[0] == 0
    ok(bm)


def test_hash_collisions_never_reuse_other_tokens():
    bm = BlockManager(64, 2, hash_bits=1)  # every hash is 0 or 1
    for i in range(10):
        t = toks(i, i + 1, i + 2, 7)
        assert bm.can_allocate(i, t)
        assert bm.allocate(i, t) == 0, "a collision must not count as a prefix hit"
        bm.mark_computed(i, t, 4)
        ok(bm)
    for i in range(10):
        bm.free(i)
    # Identical content in the cache is still found (when its entry won the hash slot).
    t = toks(0, 1, 2, 7)
    assert bm.allocate(100, t) == 2
    ok(bm)


def test_prefix_reuse_off():
    bm = BlockManager(8, 4, enable_prefix_reuse=False)
    p = toks(*range(10))
    bm.allocate(1, p)
    bm.mark_computed(1, p, 10)
    bm.free(1)
    assert bm.num_cached_blocks() == 0
    assert bm.allocate(2, p) == 0
    assert bm.stats()["prefix_hit_blocks"] == 0
    ok(bm)


def test_mark_computed_rejects_uncovered():
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(1, 2, 3))
    with pytest.raises(ValueError):
        bm.mark_computed(1, toks(*range(9)), 9)
