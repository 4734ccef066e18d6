"""A stand-in for runtime/cuda_graphs.capture_graphs where CUDA graphs cannot exist (the CPU):
`replay()` re-runs the captured call into the captured output tensors, as a graph replay
writes into its captured outputs. Everything else the graph runners do is the real code."""

from __future__ import annotations


class Recorded:
    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def record_graphs(buckets, run, prepare=None):
    graphs, outputs = {}, {}
    for b in reversed(buckets):
        if prepare is not None:
            prepare(b)
        outputs[b] = tuple(x.clone() for x in run(b))

        def again(b=b):
            results = run(b)
            for dst, src in zip(outputs[b], results, strict=True):
                dst.copy_(src)

        graphs[b] = Recorded(again)
    return graphs, outputs
