"""Greedy token selection: the two-stage argmax equals torch.argmax, ties included."""

import pytest
import torch

from ingot.runtime.sampler import (
    _argmax_chunks,
    aligned_argmax_chunks,
    default_argmax_chunks,
    greedy_tokens,
)


@pytest.mark.parametrize("vocab", [128256, 151936, 32000, 4099, 100])
def test_greedy_tokens_equals_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    # any chunking, the 16-byte-aligned one included
    c = aligned_argmax_chunks(vocab)
    assert vocab % c == 0 and (c == 1 or vocab // c % 8 == 0)
    assert torch.equal(greedy_tokens(logits, c), logits.argmax(dim=-1))


def test_aligned_argmax_chunks_of_llama3_and_qwen2_vocabularies():
    assert (aligned_argmax_chunks(128256), _argmax_chunks(128256)) == (167, 256)  # 768 / 501
    assert aligned_argmax_chunks(151936) == 16  # 151,936 = 2^7 x 1,187: chunks of 9,496


def test_greedy_tokens_ties_take_the_first_index():
    vocab = 128256
    chunk = vocab // _argmax_chunks(vocab)
    assert chunk < vocab  # the two-stage path
    logits = torch.zeros(4, vocab)
    # row 0: the max twice in one chunk; row 1: in two chunks; row 2: the last element;
    # row 3: all equal
    logits[0, [7, 9]] = 3.0
    logits[1, [chunk * 5 + 1, chunk * 2 + 3]] = 2.0
    logits[2, -1] = 1.0
    assert greedy_tokens(logits).tolist() == [7, chunk * 2 + 3, vocab - 1, 0]
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_tokens_of_half_logits_equal_those_of_the_widened_logits(dtype):
    """Sampling reads the lm_head's output in the model dtype (Decoder.step_logits); rounding
    to 8 mantissa bits makes ties common, and the first index must still win, as it does on
    the float32 logits the engine used to sample from."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 128256, generator=g) * 4).to(dtype)
    logits[0, [11, 128000]] = logits[0].max() + 1  # a tie across chunks
    wide = logits.float()
    assert torch.equal(greedy_tokens(logits), wide.argmax(dim=-1))
    assert greedy_tokens(logits)[0] == 11


def test_argmax_chunks():
    assert _argmax_chunks(128256) == 256  # 256 x 501
    assert _argmax_chunks(151936) == 128
    assert _argmax_chunks(4099) == 1  # prime: one stage
    assert _argmax_chunks(1000) == 1  # small: one stage


def test_large_batches_take_the_aligned_chunks_where_there_are_enough():
    """Llama-3 at 128 rows or more: 167 chunks of 768 (faster as graphs on the H100); one row,
    or Qwen2's vocabulary (16 aligned chunks): the default chunks."""
    assert [default_argmax_chunks(r, 128256) for r in (1, 127, 128, 512)] == [256, 256, 167, 167]
    assert default_argmax_chunks(512, 151936) == _argmax_chunks(151936) == 128
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(128, 128256, generator=g)
    logits[5, [768 * 3 + 2, 768 * 40]] = 9.0  # a tie across aligned chunks: the first wins
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[5] == 768 * 3 + 2
