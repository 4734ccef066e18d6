"""The engine's decoder against transformers' logits, and the plugin references against naive math."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.examples import make_tiny_hf_model
from ingot.plugins.attention.reference import paged_attention, write_kv
from ingot.plugins.rope.reference import inv_freq
from ingot.runtime.engine import load_engine
from ingot.runtime.kv_cache import KVCache
from ingot.runtime.model import AttnMetadata, Decoder, Ops, SampleRows, trailing_decodes


def _meta_for_prefill(lengths: list[int], bs: int, blocks_per_seq: int) -> AttnMetadata:
    """Sequence b gets blocks [b*blocks_per_seq, ...) and computes all its tokens."""
    slots, tables, qsl = [], [], [0]
    for b, n in enumerate(lengths):
        table = list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
        tables.append(table)
        slots += [table[t // bs] * bs + t % bs for t in range(n)]
        qsl.append(qsl[-1] + n)
    i32 = torch.int32
    return AttnMetadata(
        torch.tensor(slots, dtype=i32),
        torch.tensor(tables, dtype=i32),
        torch.tensor(lengths, dtype=i32),
        torch.tensor(qsl, dtype=i32),
        max(lengths),
        max(lengths),
    )


def _tiny_decoder(tmp_path, family: str, seed: int, dtype: str) -> tuple[Path, Decoder]:
    """(the HF model's dir, a CPU engine's decoder of it)."""
    hf = make_tiny_hf_model(family, tmp_path / "hf", seed=seed)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype=dtype)
    overrides = {"max_seq_len": 128, "tokens_per_block": 16}
    eng = load_engine(build_engine(ckpt, tmp_path / "eng", target="cpu", overrides=overrides))
    return hf, Decoder(eng.config.model, eng.weights(), Ops(eng.config))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_prefill_logits_match_transformers(tmp_path, family):
    hf, dec = _tiny_decoder(tmp_path, family, 4, "float32")
    m = dec.cfg
    kv = KVCache(
        m, num_blocks=16, tokens_per_block=16, dtype=torch.float32, device=torch.device("cpu")
    )
    lengths = [5, 37]
    ids = [torch.randint(0, m.vocab_size, (n,)) for n in lengths]
    meta = _meta_for_prefill(lengths, 16, 8)
    pos = torch.cat([torch.arange(n) for n in lengths]).int()
    hidden = dec.forward(torch.cat(ids).int(), pos, meta, kv)
    ours = dec.logits(hidden)
    ref_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([ref_model(x[None]).logits[0] for x in ids])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def _meta_for_step(ctx: list[int], q_lens: list[int], bs: int, blocks_per_seq: int):
    """Sequence b (blocks [b*blocks_per_seq, ...)) computes its last q_lens[b] of ctx[b]."""
    slots, tables, qsl, pos = [], [], [0], []
    for b, (c, n) in enumerate(zip(ctx, q_lens, strict=True)):
        table = list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
        tables.append(table)
        slots += [table[t // bs] * bs + t % bs for t in range(c - n, c)]
        pos += list(range(c - n, c))
        qsl.append(qsl[-1] + n)
    i32 = dict(dtype=torch.int32)
    meta = AttnMetadata(
        torch.tensor(slots, **i32),
        torch.tensor(tables, **i32),
        torch.tensor(ctx, **i32),
        torch.tensor(qsl, **i32),
        max(ctx),
        max(q_lens),
        num_decodes=trailing_decodes(q_lens),
    )
    return meta, torch.tensor(pos, **i32)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_sampling_rows_alone_finish_the_last_layer(tmp_path, family):
    """forward(rows=SampleRows) runs the last layer's attention, o projection and MLP on the
    sampling rows only: their hidden states are the full pass's (a prefill, then a step of a
    chunk continuing a cached prompt, a chunk that does not sample and a decode), and the KV
    cache it leaves is the full pass's, bit for bit."""
    _, dec = _tiny_decoder(tmp_path, family, 6, "float32")
    m, bs = dec.cfg, 16
    caches = [KVCache(m, 24, bs, torch.float32, torch.device("cpu")) for _ in range(2)]
    steps = [  # (context lens, query lens, sampling sequences)
        ([5, 37, 20], [5, 37, 20], [0, 2]),  # the middle prompt's first chunk does not sample
        ([9, 40, 21], [4, 3, 1], [0, 1, 2]),  # chunks continuing cached prompts, a decode
    ]
    for ctx, q_lens, seqs in steps:
        meta, pos = _meta_for_step(ctx, q_lens, bs, 8)
        ids = torch.randint(0, m.vocab_size, (sum(q_lens),), dtype=torch.int32)
        last = meta.query_start_loc[1:][seqs] - 1
        full = dec.forward(ids, pos, meta, caches[0])[last]
        rows = SampleRows(last.int(), torch.tensor(seqs, dtype=torch.int32))
        pruned = dec.forward(ids, pos, meta, caches[1], rows)
        assert pruned.shape == (len(seqs), m.hidden_size)
        torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[0].data, caches[1].data)


def test_step_logits_stay_in_the_model_dtype(tmp_path):
    """Sampling reads step_logits (no float32 copy of a [B, V] tensor per step); `logits` is
    the same values widened."""
    _, dec = _tiny_decoder(tmp_path, "llama", 5, "bfloat16")
    m = dec.cfg
    hidden = torch.randn(3, m.hidden_size, dtype=torch.bfloat16)
    raw = dec.step_logits(hidden)
    assert raw.dtype == torch.bfloat16 and raw.shape == (3, m.vocab_size)
    wide = dec.logits(hidden)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, raw.float())


def _naive_attention(q, k, v, scale, window=None):
    """q: [n, Hq, hd] at the last n of ctx positions; k, v: [ctx, Hkv, hd]."""
    n, hq, _ = q.shape
    ctx = k.shape[0]
    rep = hq // k.shape[1]
    out = torch.empty_like(q)
    for h in range(hq):
        kh, vh = k[:, h // rep].double(), v[:, h // rep].double()
        s = (q[:, h].double() @ kh.T) * scale
        for i in range(n):
            p = ctx - n + i
            for j in range(ctx):
                if j > p or (window is not None and p - j >= window):
                    s[i, j] = float("-inf")
        out[:, h] = (torch.softmax(s, -1) @ vh).to(q.dtype)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_reference_matches_naive(window):
    torch.manual_seed(0)
    hq, hkv, hd, bs = 4, 2, 8, 4
    ctxs, news = [7, 13, 1], [7, 3, 1]  # a prefill, a chunk over a cached prefix, a decode
    kc = torch.randn(20, bs, hkv, hd)
    vc = torch.randn(20, bs, hkv, hd)
    perm = torch.randperm(20).int()
    tables = torch.stack([perm[0:5], perm[5:10], perm[10:15]])
    ks = [torch.randn(c, hkv, hd) for c in ctxs]
    vs = [torch.randn(c, hkv, hd) for c in ctxs]
    for b, c in enumerate(ctxs):
        slots = torch.tensor([tables[b, t // bs] * bs + t % bs for t in range(c)])
        write_kv(ks[b], vs[b], kc, vc, slots)
    qs = [torch.randn(n, hq, hd) for n in news]
    qsl = torch.tensor([0, 7, 10, 11], dtype=torch.int32)
    out = paged_attention(
        torch.cat(qs), kc, vc, tables, torch.tensor(ctxs, dtype=torch.int32), qsl, 0.3, window
    )
    ref = torch.cat([_naive_attention(qs[b], ks[b], vs[b], 0.3, window) for b in range(3)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_bands():
    base = inv_freq(128, 500000.0)
    scaled = inv_freq(
        128,
        500000.0,
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    wavelen = 2 * torch.pi / base
    high = wavelen < 8192 / 4  # short wavelengths: unchanged
    low = wavelen > 8192 / 1  # long wavelengths: divided by the factor
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8.0)
    mid = ~high & ~low
    assert (
        mid.any()
        and torch.all(scaled[mid] <= base[mid])
        and torch.all(scaled[mid] >= base[mid] / 8)
    )


def test_kv_cache_has_a_scratch_block_past_the_schedulers():
    from ingot.runtime.config import ModelConfig

    m = ModelConfig("LlamaForCausalLM", "llama", 32, 16, 32, 1, 2, 1, 8, 64)
    kv = KVCache(
        m, num_blocks=5, tokens_per_block=4, dtype=torch.float32, device=torch.device("cpu")
    )
    k, v = kv.layer(0)
    assert kv.scratch_block == 5 and k.shape[0] == 6 and v.shape[0] == 6


@pytest.mark.parametrize(
    "lens,n",
    [([5, 1, 1], 2), ([1, 1, 1], 3), ([3, 1, 4], 0), ([1, 7], 0), ([], 0), ([1, 2, 1], 1)],
)
def test_trailing_decodes_counts_one_query_rows_at_the_end(lens, n):
    """AttnMetadata.num_decodes: how many sequences at the end of a step query one token (a
    mixed step's decodes, which paged attention gives the decode kernel)."""
    assert trailing_decodes(lens) == n
