"""KV-cache layouts (plugins/attention/layout.py): FP8 pools store V transposed per block; the
reference plugins see the same values through either layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from model_shapes import LLAMA_3_1_8B

from ingot.plugins.attention import reference as attn_ref
from ingot.plugins.attention.layout import check_kv_layout, is_transposed, to_v_layout, v_like
from ingot.runtime.kv_cache import KVCache

F8 = torch.float8_e4m3fn


def _model():
    """What the pool reads of a model: layers, kv heads, head dim."""
    return replace(LLAMA_3_1_8B, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("dtype", [F8, torch.bfloat16])
def test_pool_stores_v_transposed_only_for_fp8(dtype):
    kv = KVCache(
        _model(), num_blocks=3, tokens_per_block=4, dtype=dtype, device=torch.device("cpu")
    )
    k, v = kv.layer(1)
    assert k.shape == v.shape == (4, 4, 2, 8)  # num_blocks + the scratch block
    assert k.is_contiguous()
    assert is_transposed(v) == (dtype == F8) == kv.transposed_v
    assert check_kv_layout(k, v, "test") == (dtype == F8)
    # a write through the view lands in layer 1's V storage: token 2 of block 1, head 1, dim 5
    v[1, 2, 1, 5] = 3.0
    storage = kv.data[1, 1]
    if dtype == F8:  # per block [Hkv, hd, tokens]
        assert storage.reshape(4, 2, 8, 4)[1, 1, 5, 2].float() == 3.0
    else:
        assert storage[1, 2, 1, 5].float() == 3.0
    assert kv.data[0].float().abs().sum() == 0 and kv.data[1, 0].float().abs().sum() == 0


def test_reference_plugins_see_the_same_values_in_either_layout():
    torch.manual_seed(0)
    nb, bs, h, hd = 6, 4, 2, 8
    kc = torch.zeros(nb, bs, h, hd, dtype=F8)
    v_rows, v_t = torch.zeros_like(kc), v_like(kc)
    assert is_transposed(v_t) and not is_transposed(v_rows)
    T = 13
    k, v = torch.randn(T, h, hd), torch.randn(T, h, hd)
    slots = torch.randperm(nb * bs)[:T].int()
    sc = {"k_scale": torch.tensor(0.02), "v_scale": torch.tensor(0.01)}
    attn_ref.write_kv(k, v, kc.clone(), v_rows, slots, **sc)
    attn_ref.write_kv(k, v, kc, v_t, slots, **sc)
    assert torch.equal(v_t.view(torch.uint8), v_rows.view(torch.uint8))
    assert v_t.float().abs().sum() > 0
    bt = slots[: 2 * 3].long().div(bs, rounding_mode="floor").int().view(2, 3)
    q = torch.randn(2, 4, hd)
    cl, qsl = torch.tensor([9, 12]).int(), torch.tensor([0, 1, 2]).int()
    a = attn_ref.paged_attention(q, kc, v_rows, bt, cl, qsl, hd**-0.5, **sc)
    b = attn_ref.paged_attention(q, kc, v_t, bt, cl, qsl, hd**-0.5, **sc)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    # to_v_layout keeps the values and changes the strides
    back = to_v_layout(v_t, transposed=False)
    assert back.is_contiguous() and torch.equal(back.view(torch.uint8), v_rows.view(torch.uint8))


def test_other_layouts_are_refused():
    kc = torch.zeros(4, 8, 2, 16, dtype=F8)
    odd = torch.zeros(4, 2, 8, 16, dtype=F8).permute(0, 2, 1, 3)  # heads outside tokens
    with pytest.raises(ValueError, match="share K's layout or be transposed"):
        check_kv_layout(kc, odd, "write_kv")
    with pytest.raises(ValueError, match="must both be"):
        check_kv_layout(kc, torch.zeros(4, 8, 2, 8, dtype=F8), "write_kv")
    with pytest.raises(ValueError, match="K cache"):
        check_kv_layout(kc.transpose(2, 3).contiguous().transpose(2, 3), v_like(kc), "x")
