"""The CUDA-graph runners' packed input buffers (runtime/cuda_graphs.py), checked on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from ingot.runtime.cuda_graphs import batch_buckets, packed_int32, prefill_buckets


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
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256]
    assert batch_buckets(1) == [1]
    assert prefill_buckets(8192) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(64) == [16, 32, 64]
