"""Tactic timing on the GPU at Llama-3.1-8B attention shapes: an engine that runs large decode
batches gets a second decode tactic for them, timed at such a batch with its KV cache dtype;
one that never does keeps a single decode tactic."""

from __future__ import annotations

import math

import pytest
import torch
from model_shapes import LLAMA_3_1_8B

from ingot.compiler.tactic_select import timed_choices
from ingot.plugins import all_specs
from ingot.plugins.attention.layout import SHORT_CONTEXT
from ingot.plugins.attention.triton_decode import DECODE_TACTICS, LARGE_BATCH_ROWS
from ingot.runtime.config import BuildConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ONLY_ATTENTION = frozenset(s.name for s in all_specs() if s.name != "paged_attention")


def _attention_choice(max_batch_size: int, kv_fp8: bool):
    build = BuildConfig(
        max_batch_size=max_batch_size, max_seq_len=2048, max_num_tokens=2048, tokens_per_block=32
    )
    (choice,) = timed_choices(LLAMA_3_1_8B, build, skip=ONLY_ATTENTION, kv_fp8=kv_fp8)
    assert choice.name == "paged_attention"
    return choice


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_large_batch_decode_tactic_is_timed_with_the_cache_dtype(kv_fp8):
    choice = _attention_choice(64, kv_fp8)
    assert 64 * LLAMA_3_1_8B.num_kv_heads >= LARGE_BATCH_ROWS
    large = {k.split("@")[0]: ms for k, ms in choice.timings_ms.items() if "@b64_ctx1024" in k}
    assert len(large) == len(DECODE_TACTICS) and all(math.isfinite(ms) for ms in large.values())
    fastest = next(t for t in DECODE_TACTICS if t.name == min(large, key=large.get))
    picked = {k[5:]: v for k, v in choice.params.items() if k.startswith("decl_")}
    assert picked == fastest.as_dict()
    # the name's segments, not its end: a short-context tactic may follow the large one
    assert f"large:{fastest.name}" in choice.tactic.split("+")
    tag = f"@short{SHORT_CONTEXT}"
    short = {k.split("@")[0]: ms for k, ms in choice.timings_ms.items() if k.endswith(tag)}
    assert len(short) == len(DECODE_TACTICS)
    (short_pick,) = [s[6:] for s in choice.tactic.split("+") if s.startswith("short:")]
    assert short[short_pick] == min(short.values())  # ties in the recorded timings: either


def test_small_batch_engines_keep_one_decode_tactic():
    choice = _attention_choice(16, False)
    assert 16 * LLAMA_3_1_8B.num_kv_heads < LARGE_BATCH_ROWS
    assert not any(k.startswith("decl_") for k in choice.params)
    assert not any("@b" in k for k in choice.timings_ms)
