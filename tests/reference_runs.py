"""What the end-to-end tests (CPU and GPU) compare: transformers' greedy `generate`, and an
engine serving the same prompts with one of them joining while the others decode."""

from __future__ import annotations

from pathlib import Path

import torch

from ingot.runtime.engine import load_engine
from ingot.runtime.executor import Executor
from ingot.runtime.types import FinishReason, SamplingParams

PROMPT_LENS = (3, 9, 17, 30, 41, 64)


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(hf_dir: Path, prompts, dtype: torch.dtype, n: int, device: str = "cpu"):
    """transformers `generate(do_sample=False)`, one prompt at a time, exactly n new tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    # Run every prompt to exactly n tokens, as the engine does with ignore_eos.
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)  # fmt: skip
            outs.append(out[0, len(p) :].tolist())
    return outs


def strict_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of steps equal; after a request's first mismatch its later steps all count as
    misses (its context differs from then on)."""
    agree = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(x)
        for s, t in zip(x, y, strict=True):
            if s != t:
                break
            agree += 1
    return agree / total


def train_next_token_map(hf_dir: Path, steps: int = 300, seed: int = 0) -> Path:
    """Train the tiny model at `hf_dir` (in place, float32) to predict perm[token] for a fixed
    random permutation of its vocabulary, whatever the context: its greedy choices then win by
    ~9 nats instead of the near ties of random weights (top-1 margins of a few tenths of a
    nat), so engines that differ only in summation order agree token for token. ~6 s."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (32, 32), generator=g)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), perm[ids].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(hf_dir)
    return hf_dir


def serve_staggered(engine_dir: Path, prompts, n: int, **executor_kw) -> list[list[int]]:
    """All prompts but the last together; the last joins while the others are decoding."""
    return serve_engine_staggered(load_engine(engine_dir), prompts, n, **executor_kw)


def serve_engine_staggered(engine, prompts, n: int, **executor_kw) -> list[list[int]]:
    """serve_staggered on an engine already loaded."""
    ex = Executor(engine, **executor_kw)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    reqs = [ex.add_request(p, params) for p in prompts[:-1]]
    for _ in range(3):
        ex.step()
    assert any(r.output_ids for r in reqs), "nothing was decoding when the last prompt arrived"
    reqs.append(ex.add_request(prompts[-1], params))
    ex.run_until_done()
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    ex.scheduler.check_integrity()
    return [r.output_ids for r in reqs]
