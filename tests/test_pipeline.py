"""The pipelined executor (the next step launched before this one's tokens are read back) gives
exactly what the unpipelined one gives: tokens, finish reasons, callbacks, and a consistent
scheduler, through EOS and stop-check finishes, length limits, chunked prefill, prefix reuse,
preemption, cancellation and requests that join mid-run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from recorded_graphs import record_graphs

import ingot.runtime.cuda_graphs as cg
from ingot.compiler.build import build_engine
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.examples import make_tiny_hf_model
from ingot.runtime.engine import load_engine
from ingot.runtime.executor import Executor
from ingot.runtime.types import FinishReason, SamplingParams

BUILD = {"max_batch_size": 6, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 8}
# per request: new tokens; every third ignores EOS
LENGTHS = [12, 20, 9, 16, 7, 14, 11, 13, 10]


def _build(root, target: str, **kw):
    hf = make_tiny_hf_model("llama", root / "hf", seed=2)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    return load_engine(build_engine(ckpt, root / target, target=target, overrides=BUILD, **kw))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("pipeline"), "cpu")


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()  # a prefix three prompts share
    lens = [5, 90, 17, 33, 9, 40]  # 90 > max_num_tokens: chunked
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    return out + [shared + p[:6] for p in out[:3]]


def _serve(eng, prompts, params, pipeline: bool, prepare=None, **kw):
    """Half the prompts at once, the rest one per step while the others decode; one request
    cancelled after its third token. Returns (per request: tokens, reason, callback tokens),
    and the executor. prepare(executor) runs before the first request."""
    ex = Executor(eng, pipeline=pipeline, **kw)
    if prepare is not None:
        prepare(ex)
    seen: dict[int, list[int]] = {}
    stop_after = {}  # request id -> stop-check after this many tokens

    def on_token(req, tok):
        seen.setdefault(req.request_id, []).append(tok)

    def stop_check(req):
        n = stop_after.get(req.request_id)
        return n is not None and len(req.output_ids) >= n

    half = len(prompts) // 2
    reqs = [ex.add_request(p, sp) for p, sp in zip(prompts[:half], params[:half], strict=True)]
    stop_after[reqs[1].request_id] = 4
    waiting = list(zip(prompts[half:], params[half:], strict=True))
    cancelled = False
    while ex.has_unfinished() or waiting:
        if waiting:
            p, sp = waiting.pop(0)
            reqs.append(ex.add_request(p, sp))
        ex.step(on_token, stop_check)
        for r in reqs:  # the scheduler holds every token read back (the real ones)
            if not r.finished:
                known = r.prompt_ids + r.output_ids
                assert ex.scheduler.tokens(r.request_id)[: len(known)].tolist() == known
        target = reqs[2]
        if not cancelled and len(target.output_ids) >= 3 and not target.finished:
            ex.cancel(target)
            cancelled = True
    ex.scheduler.check_integrity()
    assert ex.scheduler.num_free_blocks() == ex.scheduler.config.num_blocks
    return [(r.output_ids, r.finish_reason, seen.get(r.request_id, [])) for r in reqs], ex


def _with_eos(eng, token: int):
    model = dataclasses.replace(eng.config.model, eos_token_ids=(token,))
    return dataclasses.replace(eng, config=dataclasses.replace(eng.config, model=model))


def _workload(engine, **kw):
    """(prompts, params, an EOS token the greedy runs do produce: request 4's fourth,
    unpipelined on the CPU engine)."""
    prompts = _prompts(engine.config.model.vocab_size)
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=i % 3 == 0) for i, n in enumerate(LENGTHS)
    ]
    probe, _ = _serve(engine, prompts, params, pipeline=False, **kw)
    return prompts, params, probe[4][0][3]


@pytest.mark.parametrize("policy,blocks", [("guaranteed_no_evict", None), ("max_utilization", 16)])
def test_pipelined_equals_unpipelined(engine, policy, blocks):
    kw = {"policy": policy, "num_kv_blocks": blocks}
    prompts, params, eos = _workload(engine, **kw)
    eng = _with_eos(engine, eos)
    plain, ex0 = _serve(eng, prompts, params, pipeline=False, **kw)
    piped, ex1 = _serve(eng, prompts, params, pipeline=True, **kw)
    assert piped == plain
    reasons = {r for _, r, _ in plain}
    assert {FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH} <= reasons
    assert FinishReason.CANCELLED in reasons
    for toks, _, seen in piped:
        assert seen == toks  # every token reaches the callback once, in order
    assert ex0.chained_steps == 0 and ex1.chained_steps > 0
    if policy == "max_utilization":
        assert ex1.scheduler.stats()["num_preemptions"] > 0


def test_sampled_requests_are_not_pipelined_but_agree(engine):
    """A seeded sampled request needs its logits on the host: a step in which it samples is
    read back before the next is planned, and the tokens are those of a run that never
    pipelines (its generator draws in the same order)."""
    prompts = _prompts(engine.config.model.vocab_size)[:4]
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, seed=3, ignore_eos=True)
    params = [greedy, sampled, greedy, greedy]
    runs = []
    for pipeline in (False, True):
        ex = Executor(engine, pipeline=pipeline)
        runs.append([r.output_ids for r in ex.generate(prompts, params)])
    assert runs[0] == runs[1]


def test_has_unfinished_until_the_last_step_is_read(engine):
    ex = Executor(engine, pipeline=True)
    req = ex.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    calls = 0
    while ex.has_unfinished():
        ex.step()
        calls += 1
        assert calls < 10
    assert len(req.output_ids) == 3 and req.finish_reason == FinishReason.LENGTH
    assert ex.step() == []  # nothing left: a no-op


@pytest.mark.parametrize("pipeline", [False, True])
def test_steps_with_prompts_in_prefill_graphs_give_the_eager_tokens(engine, monkeypatch, pipeline):
    """Prefill graphs (runtime/cuda_graphs.py) run steps of several sequences with prompt
    tokens: prompts that arrive together, a chunk beside decodes (chained: their input
    tokens from the device). Their padding (empty sequence slots, the padding sequence, the
    discarded sampling rows) changes no token. On the CPU the graphs are recorded (re-run into
    their outputs); the GPU test below captures them."""
    monkeypatch.setattr(cg, "capture_graphs", record_graphs)
    prompts, params, eos = _workload(engine)
    eng = _with_eos(engine, eos)
    eager, _ = _serve(eng, prompts, params, pipeline=pipeline)
    steps = []  # per graphed step: graph key, prompts, sequences, chained

    def graphs(ex):
        width = ex.scheduler.config.max_blocks_per_seq
        keys = cg.prefill_graph_keys([16, 32, 64], 6)  # tiers 1 and 6 (max_batch_size)
        pg = cg.PrefillGraphs(ex.decoder, ex.kv, keys, width, ex.device)
        run = pg.run

        def counted(plan, rows, ids=None):
            steps.append((pg.key(plan, rows), plan.num_prefill, plan.num_seqs, ids is not None))
            return run(plan, rows, ids)

        pg.run, ex.prefill_graphs = counted, pg

    graphed, ex = _serve(eng, prompts, params, pipeline=pipeline, prepare=graphs)
    assert graphed == eager
    assert {key[0] for key, *_ in steps} == {6}, steps  # up to six sequences
    assert any(p > 1 for _, p, _, _ in steps)  # several prompts in one graph
    assert any(p < n for _, p, n, _ in steps)  # a mixed step
    assert any(chained for *_, chained in steps) == pipeline
    # a lone prompt: the tier of one sequence
    lone = SamplingParams(max_new_tokens=4, ignore_eos=True)
    alone = ex.generate([prompts[2]], lone)[0].output_ids
    assert steps[-1][0][0] == 1  # (its prefix reused: the last tokens only)
    assert alone == Executor(eng).generate([prompts[2]], lone)[0].output_ids


def test_prefill_graph_inputs_pad_the_step_with_empty_and_padding_sequences():
    """A mixed step of a 5-token chunk and two decodes in the tier-4, 16-token graph: three
    real sequences, one empty slot, the padding sequence (9 tokens, scratch block); sampling
    rows of the chunk and the second decode, then padding-sequence rows."""
    pg = cg.PrefillGraphs.__new__(cg.PrefillGraphs)
    pg.kv = SimpleNamespace(scratch_block=7, tokens_per_block=8)
    _, _, h, _ = cg.packed_int32([16, 16, 16, 5, 6, 4, 4, 5 * 3], torch.device("cpu"))
    pg.h = h[:7] + [h[7].reshape(5, 3)]
    tables = np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]], np.int32)
    pg._fill((4, 16), np.arange(7) + 100, [0, 1, 2, 3, 4, 8, 20], np.arange(7) + 50,
             [5, 9, 21], [0, 5, 6, 7], tables, np.array([0, 2]))  # fmt: skip
    ids, pos, slots, ctx, qsl, last, seqs, tab = pg.h
    assert ids.tolist() == [*range(100, 107)] + [0] * 9
    assert pos[7:].tolist() == [0] * 9 and slots[7:].tolist() == [56] * 9
    assert ctx.tolist() == [5, 9, 21, 1, 9] and qsl.tolist() == [0, 5, 6, 7, 7, 16]
    assert tab[:3].tolist() == tables.tolist() and (tab[3:] == 7).all()
    assert last.tolist() == [4, 6, 15, 15] and seqs.tolist() == [0, 2, 4, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_pipelined_on_the_gpu_equals_unpipelined_and_the_cpu_engine(tmp_path, engine, graphs):
    """On the GPU a chained decode takes its input tokens from the previous step's argmax on
    the device (in the decode graphs, or eagerly), its inputs are staged while the previous
    copy may still be queued, and the tokens come back through pinned buffers and events."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = _build(tmp_path, "auto", tactics="default")
    prompts, params, eos = _workload(engine)
    cpu, _ = _serve(_with_eos(engine, eos), prompts, params, pipeline=False)
    plain, _ = _serve(_with_eos(gpu, eos), prompts, params, pipeline=False, cuda_graphs=graphs)
    piped, ex = _serve(_with_eos(gpu, eos), prompts, params, pipeline=True, cuda_graphs=graphs)
    assert piped == plain == cpu
    assert ex.chained_steps > 0
