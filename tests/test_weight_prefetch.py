"""The decoder's L2 weight prefetch (runtime/weight_prefetch.py), on the CPU: which weights a
small step reads ahead and in what order, that larger steps read none ahead, and that it changes
no result. The kernel itself compiles for sm_90 in tests/test_kernel_bundle.py; its effect on
the GPU is in tests/test_gpu_e2e.py and the batch-1 benchmark."""

from __future__ import annotations

import torch
from test_model_cpu import _meta_for_prefill, _tiny_decoder

from ingot.runtime.kv_cache import KVCache
from ingot.runtime.weight_prefetch import MAX_TOKENS, WeightPrefetch


class _Recorder:
    """Stands in for WeightPrefetch: the tensors issued, and the joins."""

    def __init__(self) -> None:
        self.issued: list[torch.Tensor] = []
        self.joins = 0

    def issue(self, w: torch.Tensor) -> None:
        self.issued.append(w)

    def join(self) -> None:
        self.joins += 1


def _run(dec, n_tokens: int, prefetch) -> torch.Tensor:
    dec.prefetch = prefetch
    m = dec.cfg
    kv = KVCache(m, num_blocks=8, tokens_per_block=16, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.vocab_size, (n_tokens,), generator=gen).int()
    meta = _meta_for_prefill([n_tokens], 16, 8)
    return dec.forward(ids, torch.arange(n_tokens).int(), meta, kv)


def test_small_steps_read_each_gemv_weight_ahead_in_order(tmp_path):
    _, dec = _tiny_decoder(tmp_path, "llama", 3, "float32")
    w, n = dec.w, dec.cfg.num_layers
    expected = [w["layers.0.attn.qkv.weight"]]
    for i in range(n):
        nxt = w[f"layers.{i + 1}.attn.qkv.weight"] if i + 1 < n else dec.lm_head
        expected += [w[f"layers.{i}.attn.o.weight"], w[f"layers.{i}.mlp.gate_up.weight"], nxt]
    plain = _run(dec, MAX_TOKENS, None)
    rec = _Recorder()
    ahead = _run(dec, MAX_TOKENS, rec)
    assert len(rec.issued) == len(expected) == 1 + 3 * n
    assert all(a is b for a, b in zip(rec.issued, expected, strict=True))
    assert rec.joins == 1  # the side stream joins back once, at the end of the forward pass
    assert torch.equal(ahead, plain)
    assert dec._pf is None  # nothing is left active for the next (maybe larger) step


def test_larger_steps_read_nothing_ahead(tmp_path):
    _, dec = _tiny_decoder(tmp_path, "llama", 3, "float32")
    rec = _Recorder()
    _run(dec, MAX_TOKENS + 1, rec)
    assert rec.issued == [] and rec.joins == 0


def test_prefetch_is_for_gpu_engines_only(tmp_path):
    _, dec = _tiny_decoder(tmp_path, "llama", 3, "float32")
    dec.set_l2_prefetch(True)  # a CPU engine: nothing to read ahead into
    assert dec.prefetch is None
    dec.set_l2_prefetch(True, torch.device("meta"))  # the builder's dry run records launches
    assert isinstance(dec.prefetch, WeightPrefetch) and dec.prefetch.side is None
    dec.set_l2_prefetch(False, torch.device("meta"))
    assert dec.prefetch is None
