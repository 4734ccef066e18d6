"""RoPE + KV write into a transposed (FP8) V cache a segment of tokens at a time
(plugins/attention/triton_kv_write.py: write_v_segments) against the per-token kernel: the
same cache bytes. Run by Triton's interpreter (tests/test_v_segments_interp.py) and on the GPU
(tests/test_gpu_quant.py)."""

from __future__ import annotations

import torch
from kernel_checks import same_bits

from ingot.plugins.attention import triton_kv_write as kv_write
from ingot.plugins.attention.layout import v_like
from ingot.plugins.rope import reference as rope_ref
from ingot.plugins.rope import triton_kernels as rope_gpu

F8 = torch.float8_e4m3fn


def slot_patterns(bs: int, nb: int, gen: torch.Generator) -> dict[str, list[int]]:
    """Slots of a step's tokens: prompts from block starts (whole segments), a chunk
    continuing a cached prompt mid-block, scattered slots, padding."""
    blocks = torch.randperm(nb, generator=gen).tolist()

    def run(first_block: int, start: int, n: int) -> list[int]:
        out, pos = [], start
        for _ in range(n):
            out.append(blocks[first_block + pos // bs] * bs + pos % bs)
            pos += 1
        return out

    per_seq = -(-160 // bs)  # blocks per sequence here
    prompts = run(0, 0, 100) + run(per_seq, 0, 37)
    chunk = run(0, 40, 90) + run(per_seq, 3, 8)
    scattered = torch.randperm(nb * bs, generator=gen)[:96].tolist()
    padded = run(0, 0, 70)
    padded[5] = padded[66] = -1
    return {"prompts": prompts, "chunk": chunk, "scattered": scattered, "padded": padded}


def v_segments_equal_per_token(bs: int, device, monkeypatch, v_rows_cut: int = 0) -> None:
    gen = torch.Generator().manual_seed(bs)
    hq, hkv, hd, nb = 4, 2, 32, 2 * -(-160 // bs)  # two sequences of up to 160 tokens
    cos, sin = (t.to(device) for t in rope_ref.cos_sin_cache(rope_ref.inv_freq(hd, 1e4), 300))
    scales = {
        "k_scale": torch.tensor(0.05, device=device),
        "v_scale": torch.tensor(0.02, device=device),
    }
    fn = rope_gpu.make_rope_write_kv(None)
    # NOTE: the threshold and kernel as defined: the rope module's names are patched below,
    # and a second call in the same test read the 10**9 the first one left there
    min_tokens, write_segments, calls = kv_write.V_SEGMENT_MIN_TOKENS, kv_write.write_v_segments, []
    monkeypatch.setattr(rope_gpu, "write_v_segments",
                        lambda *a: calls.append(a[-1]) or write_segments(*a))  # fmt: skip
    for name, slots in slot_patterns(bs, nb, gen).items():
        T = len(slots)
        qkv = (torch.randn(T, (hq + 2 * hkv) * hd, generator=gen) * 2).to(torch.bfloat16)
        qkv = qkv.to(device)
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        q, k, v = q.view(T, hq, hd), k.view(T, hkv, hd), v.view(T, hkv, hd)
        pos = torch.randint(0, 300, (T,), generator=gen, dtype=torch.int32).to(device)
        sl = torch.tensor(slots, dtype=torch.int32, device=device)
        v_rows = T - v_rows_cut if v_rows_cut else None
        out, calls[:] = [], []
        for least in (min_tokens, 10**9):  # segments, then per token
            monkeypatch.setattr(rope_gpu, "V_SEGMENT_MIN_TOKENS", least)
            kc = torch.zeros(nb, bs, hkv, hd, dtype=F8, device=device)
            vc = v_like(kc)
            qo = fn(q, k, v, pos, cos, sin, kc, vc, sl, **scales, v_rows=v_rows, runs=T - 5)
            out.append((qo, kc, vc))
        (q1, k1, v1), (q2, k2, v2) = out
        assert calls == [T - 5]  # the segment kernel ran once, on all but the last 5 tokens
        assert torch.equal(q1, q2), name
        assert same_bits(k1, k2) and same_bits(v1, v2), name
        assert v1.float().abs().sum() > 0, name  # something was written
