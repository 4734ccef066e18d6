"""Packed input buffers: the CUDA-graph runners' (runtime/cuda_graphs.py) and the eager
steps' (runtime/step_inputs.py), checked on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

import ingot.runtime.cuda_graphs as cg
from ingot.runtime.cuda_graphs import (
    LARGE_PAD_MAX,
    batch_buckets,
    packed_int32,
    prefill_bucket,
    prefill_buckets,
    prefill_graph_keys,
)
from ingot.runtime.step_inputs import StepInputs


def test_packed_segments_are_aligned_views_of_one_buffer():
    sizes = [5, 5, 5, 2, 3, 1, 2 * 7]  # the prefill runner's odd sizes
    host, dev, h, d = packed_int32(sizes, torch.device("cpu"))
    assert [len(x) for x in h] == sizes and [x.numel() for x in d] == sizes
    # Triton specializes on 16-byte pointer alignment: every segment starts aligned
    assert all(x.data_ptr() % 16 == 0 for x in d)
    assert len({x.data_ptr() for x in d}) == len(d)
    for i, x in enumerate(h):  # host views write into the one host buffer...
        x[:] = np.arange(len(x)) + 100 * i
    dev.copy_(host)  # ...and one copy moves every segment
    for i, x in enumerate(d):
        assert x.tolist() == (np.arange(sizes[i]) + 100 * i).tolist()


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 192, 256]
    assert batch_buckets(2048)[-9:] == [320, 384, 448, 512, 640, 768, 896, 1024, 2048]
    assert batch_buckets(700)[-4:] == [448, 512, 640, 700]
    assert batch_buckets(1) == [1]
    large = [768, 1024, 1280, 1536, 1792, 2048]
    assert prefill_buckets(8192) == [16, 32, 64, 128, 256, 512, *large]
    assert prefill_buckets(64) == [16, 32, 64]
    assert prefill_buckets(1100) == [16, 32, 64, 128, 256, 512, 768, 1024]


def test_prefill_bucket_pads_a_large_prompt_by_little_or_runs_it_eagerly():
    b = prefill_buckets(8192)
    # up to 512 tokens: the smallest power of two that holds the prompt, however padded
    assert [prefill_bucket(b, t) for t in (1, 16, 17, 300, 512)] == [16, 16, 32, 512, 512]
    # above: a bucket only within LARGE_PAD_MAX tokens of it
    assert prefill_bucket(b, 768 - LARGE_PAD_MAX) == 768
    assert prefill_bucket(b, 768 - LARGE_PAD_MAX - 1) is None
    assert prefill_bucket(b, 513) is None
    assert [prefill_bucket(b, t) for t in (2000, 2048)] == [2048, 2048]
    assert prefill_bucket(b, 2049) is None  # past the largest graph


def test_prefill_graph_keys_and_the_graph_a_step_takes():
    """Tiers 1 and 8 at every token bucket, 64 (the default max_batch_size) up to 512
    tokens, capped at max_batch_size; a step takes the smallest tier holding its sequences at
    its bucket, or runs eagerly (none: too many sequences, a bucket too padded, no prompt
    tokens or no sampling row)."""
    b = prefill_buckets(8192)
    keys = prefill_graph_keys(b, 64)
    assert keys[:3] == [(1, 16), (8, 16), (64, 16)] and keys[-2:] == [(1, 2048), (8, 2048)]
    assert {s for s, t in keys if t > 512} == {1, 8} and len(keys) == 2 * 12 + 6
    assert {s for s, _ in prefill_graph_keys(b, 4)} == {1, 4}
    assert {s for s, _ in prefill_graph_keys(b, 1)} == {1}
    pg = cg.PrefillGraphs.__new__(cg.PrefillGraphs)
    pg.buckets, pg.tiers = b, [1, 8, 64]
    pg.graphs = dict.fromkeys(keys)

    def key(seqs: int, tokens: int, prompts: int = 1, rows=(0,)):
        plan = SimpleNamespace(num_seqs=seqs, num_tokens=tokens, num_prefill=prompts)
        return pg.key(plan, np.array(rows))

    assert key(1, 128) == (1, 128) and key(2, 100) == (8, 128) and key(9, 300) == (64, 512)
    assert key(8, 2000) == (8, 2048) and key(9, 2000) is None  # no tier 64 past 512 tokens
    assert key(65, 300) is None and key(1, 700) is None  # 700: padded by more than 64
    assert key(4, 4, prompts=0) is None and key(1, 128, rows=()) is None


def test_step_inputs_round_trip_aligned_and_reuse_the_buffer():
    inputs = StepInputs(torch.device("cpu"))
    rng = np.random.default_rng(0)
    for step, (t, b, w) in enumerate([(7, 2, 3), (2048, 1, 64), (5, 3, 2)]):
        arrays = {
            "input_ids": rng.integers(0, 1000, t, dtype=np.int32),
            "block_tables": rng.integers(0, 99, (b, w), dtype=np.int32),
            "last": np.array([t - 1], dtype=np.int64),  # cast to int32
            "query_start_loc": np.array([0, t], dtype=np.int32),
        }
        got = inputs.put(arrays)
        assert list(got) == list(arrays)
        for k, a in arrays.items():
            assert got[k].dtype == torch.int32 and got[k].shape == a.shape
            assert got[k].tolist() == a.tolist(), k
            assert got[k].data_ptr() % 16 == 0  # Triton's aligned kernel variants
        if step == 1:
            grown = inputs._host.numel()
    assert inputs._host.numel() == grown  # the smaller third step reused the buffer


def test_prefill_graph_pool_is_reserved_only_when_graphs_are_captured():
    from model_shapes import LLAMA_3_1_8B

    from ingot.runtime.config import BuildConfig
    from ingot.runtime.memory import activation_bytes, token_activation_bytes

    m, bf16 = LLAMA_3_1_8B, torch.bfloat16
    # logits rows of every graph (the default max_batch_size, 64): tiers 1 and 8 at each
    # bucket, 64 up to 512 tokens
    for tokens, rows in ((8192, 9 * 12 + 64 * 6), (512, (1 + 8 + 64) * 6)):
        b = BuildConfig(max_num_tokens=tokens, target="sm_90")
        pool = token_activation_bytes(m, min(2048, tokens), bf16) + rows * m.vocab_size * 4
        with_graphs = activation_bytes(m, b, bf16)
        assert pool > 0 and activation_bytes(m, b, bf16, prefill_graphs=False) == with_graphs - pool
