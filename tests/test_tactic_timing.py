"""Tactic timing on the CPU: the inputs a GPU build times each kernel with fit that kernel's
call, and a build stops when no candidate of an op runs at all (the H200 bench JSON once showed
every paged_attention candidate at `inf`: the shared inputs carried a keyword neither kernel
takes, so the engine silently kept the default tactics)."""

from __future__ import annotations

import inspect

import pytest
import torch
from model_shapes import LLAMA_3_1_8B

from ingot.compiler.tactic_select import _Shapes, pick_over_contexts
from ingot.plugins import tactics
from ingot.plugins.attention import triton_decode as dec
from ingot.plugins.attention.layout import is_transposed
from ingot.plugins.attention.triton_decode import make_decode_attention
from ingot.plugins.attention.triton_prefill import make_prefill_attention
from ingot.plugins.tactics import Tactic, time_tactics
from ingot.runtime.config import BuildConfig

BUILD = BuildConfig(max_batch_size=8, max_seq_len=256, max_num_tokens=64, tokens_per_block=16)


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("n_q,factory", [(1, make_decode_attention), (64, make_prefill_attention)])
def test_attention_timing_inputs_bind_to_the_kernel(n_q, factory, kv_fp8):
    args, kwargs = _Shapes(LLAMA_3_1_8B, BUILD, device="cpu").attention(n_q, 128, kv_fp8)
    inspect.signature(factory(None)).bind(*args, **kwargs)  # TypeError on a stray keyword
    assert args[0].shape == (n_q, LLAMA_3_1_8B.num_heads, LLAMA_3_1_8B.head_dim)
    # an FP8-KV engine's attention is timed on an FP8 cache in the pool's layout
    kc, vc = args[1:3]
    assert (kc.dtype == vc.dtype == torch.float8_e4m3fn) == kv_fp8 == ("v_scale" in kwargs)
    assert is_transposed(vc) == kv_fp8


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_large_batch_timing_inputs_bind_and_use_the_cache_dtype(kv_fp8):
    args, kwargs = _Shapes(LLAMA_3_1_8B, BUILD, device="cpu").decode_batch(40, 100, kv_fp8)
    inspect.signature(make_decode_attention(None)).bind(*args, **kwargs)
    q, kc, _, tables, ctx, qsl = args[:6]
    assert q.shape[0] == tables.shape[0] == ctx.shape[0] == qsl.shape[0] - 1 == 40
    assert (kc.dtype == torch.float8_e4m3fn) == kv_fp8 == ("k_scale" in kwargs)
    assert len(set(tables[:, :7].flatten().tolist())) == 40 * 7  # ceil(100 / 16) blocks each
    assert kc.shape[0] == 40 * 7 + 1


def test_large_batches_run_the_large_batch_decode_tactic(monkeypatch):
    """A paged_attention tactic with a large-batch decode tactic launches it from
    LARGE_BATCH_ROWS sequences x kv heads on, and its small-batch one below."""
    small, large = dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[-2]
    seen = []
    monkeypatch.setattr(dec, "launch_decode", lambda *a, **kw: seen.append(a[9]))
    fn = dec.make_paged_attention(dec.combine_tactics(small, dec.PREFILL_TACTICS[0], large))
    hkv = LLAMA_3_1_8B.num_kv_heads
    for batch in (1, dec.LARGE_BATCH_ROWS // hkv - 1, dec.LARGE_BATCH_ROWS // hkv, 128):
        args, kwargs = _Shapes(LLAMA_3_1_8B, BUILD, device="cpu").decode_batch(batch, 20, False)
        fn(*args, max_query_len=1, **kwargs)
    assert seen == [small.as_dict()] * 2 + [large.as_dict()] * 2
    seen.clear()
    dec.make_paged_attention(dec.combine_tactics(small, dec.PREFILL_TACTICS[0]))(
        *args, max_query_len=1, **kwargs
    )
    assert seen == [small.as_dict()]  # without one, the small-batch tactic serves all


def test_large_batch_decode_tactic_override_for_ab_runs(monkeypatch):
    """INGOT_LARGE_DECODE_TACTIC replaces the large-batch tactic (not the small-batch one) on
    an engine already built; an unknown name says which are known."""
    small, large, other = dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[-2], dec.DECODE_TACTICS[-1]
    seen = []
    monkeypatch.setattr(dec, "launch_decode", lambda *a, **kw: seen.append(a[9]))
    monkeypatch.setenv(dec.LARGE_DECODE_ENV, other.name)
    fn = dec.make_paged_attention(dec.combine_tactics(small, dec.PREFILL_TACTICS[0], large))
    shapes = _Shapes(LLAMA_3_1_8B, BUILD, device="cpu")
    for batch in (1, 128):
        args, kwargs = shapes.decode_batch(batch, 20, False)
        fn(*args, max_query_len=1, **kwargs)
    assert seen == [small.as_dict(), other.as_dict()]
    monkeypatch.setenv(dec.LARGE_DECODE_ENV, "p1_nope")
    with pytest.raises(ValueError, match="p128_n32_w1_s3_t4096"):
        fn(*args, max_query_len=1, **kwargs)


def test_short_context_launches_run_the_short_context_decode_tactic(monkeypatch):
    """A paged_attention tactic with a short-context decode tactic launches it for decode
    steps bounded by SHORT_CONTEXT keys (the decode graphs' short tier), and its decode tactic
    past that bound; large batches keep the large-batch one; without one, the decode tactic."""
    from ingot.plugins.attention.layout import SHORT_CONTEXT

    main, short, large = dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[1], dec.DECODE_TACTICS[-2]
    seen = []
    monkeypatch.setattr(dec, "launch_decode", lambda *a, **kw: seen.append((a[9], a[7])))
    fn = dec.make_paged_attention(dec.combine_tactics(main, dec.PREFILL_TACTICS[0], large, short))
    shapes = _Shapes(LLAMA_3_1_8B, BUILD, device="cpu")
    big = dec.LARGE_BATCH_ROWS // LLAMA_3_1_8B.num_kv_heads
    for batch, bound in ((1, SHORT_CONTEXT), (1, SHORT_CONTEXT + 1), (big, SHORT_CONTEXT)):
        args, kwargs = shapes.decode_batch(batch, 20, False)
        fn(*args, max_query_len=1, **(kwargs | {"max_context_len": bound}))
    assert seen == [(short.as_dict(), SHORT_CONTEXT), (main.as_dict(), SHORT_CONTEXT + 1),
                    (large.as_dict(), SHORT_CONTEXT)]  # fmt: skip
    seen.clear()
    dec.make_paged_attention(dec.combine_tactics(main, dec.PREFILL_TACTICS[0]))(
        *args, max_query_len=1, **(kwargs | {"max_context_len": 64})
    )
    assert seen == [(main.as_dict(), 64)]


def test_the_build_times_a_short_context_decode_tactic_under_its_bound(monkeypatch):
    """Engines whose contexts may pass SHORT_CONTEXT time the decode tactics at 256 keys with
    SHORT_CONTEXT as the launch's bound and keep the fastest as the short-context tactic;
    engines whose contexts all fit it do not (their decode tactic is timed there)."""
    from ingot.compiler import tactic_select
    from ingot.plugins import all_specs
    from ingot.plugins.attention.layout import SHORT_CONTEXT

    bounds, fastest = [], dec.DECODE_TACTICS[3]

    def fake_time(name, cands, inputs, factory=None, repeats=None, before=None, **_):
        if factory is make_decode_attention and len(cands) == len(dec.DECODE_TACTICS):
            monkeypatch.setattr(tactic_select._Shapes, "_paged", lambda *a: ((), {}))
            bound = inputs()[1].get("max_context_len")
            bounds.append(bound)
            if bound == SHORT_CONTEXT:  # the short tier's timing: `fastest` wins there
                return sorted(((c, 0.5 if c is fastest else 1.0) for c in cands),
                              key=lambda r: r[1])  # fmt: skip
        return [(c, 1.0 + i) for i, c in enumerate(cands)]

    monkeypatch.setattr(tactics, "time_tactics", fake_time)
    skip = frozenset(s.name for s in all_specs() if s.name != "paged_attention")
    for max_seq_len, short in ((4096, True), (SHORT_CONTEXT, False)):
        bounds.clear()
        build = BuildConfig(max_batch_size=4, max_seq_len=max_seq_len, max_num_tokens=512,
                            tokens_per_block=32)  # fmt: skip
        (choice,) = tactic_select.timed_choices(LLAMA_3_1_8B, build, skip=skip)
        assert bounds == [max_seq_len] * 2 + ([SHORT_CONTEXT] if short else []), bounds
        assert choice.tactic.endswith(f"+short:{fastest.name}") == short, choice.tactic
        assert (f"{fastest.name}@short{SHORT_CONTEXT}" in choice.timings_ms) == short


def test_short_prompt_launches_run_the_short_prompt_prefill_tactic(monkeypatch):
    """A paged_attention tactic with a short-prompt prefill tactic launches it where the
    longest prompt has at most SHORT_PROMPT queries, its prefill tactic past that; without
    one, the prefill tactic everywhere."""
    from ingot.plugins.attention.triton_prefill import SHORT_PROMPT, SHORT_PROMPT_TACTICS

    long, short = dec.PREFILL_TACTICS[0], SHORT_PROMPT_TACTICS[0]
    seen = []
    monkeypatch.setattr(dec, "launch_prefill", lambda *a, **kw: seen.append((a[10], a[8])))
    build = BuildConfig(max_batch_size=8, max_seq_len=1024, max_num_tokens=2048,
                        tokens_per_block=16)  # fmt: skip
    shapes = _Shapes(LLAMA_3_1_8B, build, device="cpu")
    both = dec.combine_tactics(dec.DECODE_TACTICS[0], long, short_prefill=short)
    assert both.name.endswith(f"+prompts:{short.name}")
    for n in (SHORT_PROMPT, SHORT_PROMPT + 1):
        args, kwargs = shapes.prompts(2, n)
        dec.make_paged_attention(both)(*args, **kwargs)
    args, kwargs = shapes.prompts(2, 16)
    dec.make_paged_attention(dec.combine_tactics(dec.DECODE_TACTICS[0], long))(*args, **kwargs)
    assert seen == [(short.as_dict(), SHORT_PROMPT), (long.as_dict(), SHORT_PROMPT + 1),
                    (long.as_dict(), 16)]  # fmt: skip
    # INGOT_SHORT_PROMPT_TACTIC (A/Bs on one engine): another tactic, or the 2,048-token pick
    other = SHORT_PROMPT_TACTICS[-1]
    for value, want in ((other.name, other), ("long", long)):
        seen.clear()
        monkeypatch.setenv(dec.SHORT_PROMPT_ENV, value)
        for n in (16, SHORT_PROMPT + 1):
            args, kwargs = shapes.prompts(2, n)
            dec.make_paged_attention(both)(*args, **kwargs)
        assert seen == [(want.as_dict(), 16), (long.as_dict(), SHORT_PROMPT + 1)]
    monkeypatch.setenv(dec.SHORT_PROMPT_ENV, "m1_n1")
    with pytest.raises(ValueError, match="not a prefill tactic"):
        dec.make_paged_attention(both)(*shapes.prompts(2, 16)[0], max_query_len=16)


@pytest.mark.parametrize("case", ["short_wins", "long_pick_wins", "batch_1_engine"])
def test_the_build_times_a_short_prompt_prefill_tactic_on_a_batch_of_short_prompts(
    monkeypatch, case
):
    """The build times the prefill tactics and SHORT_PROMPT_TACTICS on 64 prompts of 128
    tokens (128/128's mixed steps) and keeps the fastest as the short-prompt tactic, unless it
    is the 2,048-token pick anyway; an engine of one sequence never runs such a batch."""
    from ingot.compiler import tactic_select
    from ingot.plugins import all_specs
    from ingot.plugins.attention.triton_prefill import PREFILL_TACTICS, SHORT_PROMPT_TACTICS

    seen, fastest = [], SHORT_PROMPT_TACTICS[1] if case == "short_wins" else PREFILL_TACTICS[0]

    def prompts(self, batch, n, kv_fp8=False):
        seen.append((batch, n, kv_fp8))
        return (), {}

    def fake_time(name, cands, inputs, factory=None, repeats=None, before=None, **_):
        if factory is make_prefill_attention and len(cands) > len(PREFILL_TACTICS):
            inputs()
            return sorted(((c, 0.5 if c is fastest else 1.0) for c in cands), key=lambda r: r[1])
        return [(c, 1.0 + i) for i, c in enumerate(cands)]

    monkeypatch.setattr(tactic_select._Shapes, "prompts", prompts)
    monkeypatch.setattr(tactics, "time_tactics", fake_time)
    skip = frozenset(s.name for s in all_specs() if s.name != "paged_attention")
    build = BuildConfig(max_batch_size=1 if case == "batch_1_engine" else 512, max_seq_len=4096,
                        max_num_tokens=8192, tokens_per_block=32)  # fmt: skip
    (choice,) = tactic_select.timed_choices(LLAMA_3_1_8B, build, skip=skip, kv_fp8=True)
    assert seen == ([] if case == "batch_1_engine" else [(64, 128, True)])
    assert ("+prompts:" in choice.tactic) == (case == "short_wins"), choice.tactic
    if case == "short_wins":
        assert choice.tactic.endswith(f"+prompts:{fastest.name}")
        assert f"{fastest.name}@64x128" in choice.timings_ms


def _fake_timer(fn, repeats, before=None):
    fn()
    return 1.0


def test_one_failing_candidate_is_skipped_but_all_failing_is_an_error(monkeypatch):
    monkeypatch.setattr(tactics, "_median_ms", _fake_timer)
    good, bad = Tactic("good"), Tactic("bad")

    def factory(t):
        def fn(x):
            if t is bad:
                raise ValueError("out of shared memory")
            return x

        return fn

    res = time_tactics("op", [bad, good], lambda: ((1,), {}), factory=factory)
    assert res == [(good, 1.0), (bad, float("inf"))]
    with pytest.raises(RuntimeError, match="no op tactic ran: out of shared memory"):
        time_tactics("op", [bad], lambda: ((1,), {}), factory=factory)


def test_a_predecessor_runs_before_each_candidate_all_in_pdl_scope(monkeypatch):
    """time_tactics(before=...): the timer gets the candidate and its predecessor, both
    launching their PDL kernel variants (a PDL engine's decode step), and nothing else does."""
    from ingot.plugins import pdl

    seen = []

    def timer(fn, repeats, before=None):
        before()
        fn()
        return 1.0

    monkeypatch.setattr(tactics, "_median_ms", timer)

    def factory(t):
        return lambda x: seen.append((t.name, x, pdl.active()))

    def norm():
        seen.append(("norm", None, pdl.active()))

    res = time_tactics("op", [Tactic("a"), Tactic("b")], lambda: ((7,), {}), factory=factory,
                       before=norm)  # fmt: skip
    assert [t.name for t, _ in res] == ["a", "b"]
    # each candidate's first call (its compile, side by side in threads), then the timings
    assert sorted(seen[:2]) == [("a", 7, True), ("b", 7, True)]
    assert seen[2:] == [("norm", None, True), ("a", 7, True), ("norm", None, True), ("b", 7, True)]
    assert not pdl.active()


def test_pdl_timing_without_a_predecessor_runs_every_candidate_in_pdl_scope(monkeypatch):
    """time_tactics(pdl=True): each candidate's first call and its timing launch the PDL
    variants (their extra registers counted) with nothing run before them; without it, none."""
    from ingot.plugins import pdl

    seen = []
    monkeypatch.setattr(tactics, "_median_ms", _fake_timer)

    def factory(t):
        return lambda x: seen.append((t.name, pdl.active()))

    for on in (True, False):
        seen.clear()
        time_tactics("op", [Tactic("a"), Tactic("b")], lambda: ((7,), {}), factory=factory,
                     pdl=on)  # fmt: skip
        assert sorted(seen) == [("a", on), ("a", on), ("b", on), ("b", on)]
    assert not pdl.active()


def test_a_pdl_build_times_every_batch1_candidate_as_its_pdl_variant(monkeypatch):
    """With PDL on, every timing at a decode step's size (each GEMM site's GEMV candidates,
    BF16, FP8 and INT4, the gated SwiGLU GEMVs, the norms, INT4's small-batch half) asks for
    PDL variants, INT4's down GEMV too though nothing runs before it; the prefill-sized ones
    (INT4's GEMM half, its 16-64-row half) and every timing of a build without PDL do not.
    Each GEMM site's batch-1 GEMVs are timed after what the engine runs before them: decode
    attention before o; before qkv and gate_up the norm (an FP8 engine's quantizing one);
    before BF16 and FP8 down the SwiGLU (-quantize) kernel; the norm before the lm_head."""
    from ingot.compiler import tactic_select
    from ingot.plugins import all_specs
    from ingot.plugins.attention import triton_decode

    init = tactic_select._Shapes.__init__
    monkeypatch.setattr(tactic_select._Shapes, "__init__",
                        lambda self, m, b, device="cuda": init(self, m, b, "meta"))  # fmt: skip
    ran = []  # the predecessor ops a timing ran
    resolve = tactics.resolve_factory
    preds = ("add_rms_norm", "rms_norm_quant_fp8", "swiglu", "swiglu_quant_fp8")
    monkeypatch.setattr(tactics, "resolve_factory", lambda n: (
        (lambda t: lambda *a, **k: ran.append(n)) if n in preds else resolve(n)))  # fmt: skip
    monkeypatch.setattr(triton_decode, "make_decode_attention",
                        lambda t: lambda *a, **k: ran.append("attention"))  # fmt: skip
    skip = frozenset(s.name for s in all_specs() if s.name == "paged_attention")
    for on in (True, False):
        seen = []

        def fake_time(name, cands, inputs, factory=None, repeats=None, before=None, pdl=False,
                      seen=seen, **_):  # fmt: skip
            ran.clear()
            if before is not None:
                before()
            rows = inputs()[0][0].shape[0]
            seen.append((name, rows, pdl, ran[0] if ran else None))
            return [(c, 1.0 + i) for i, c in enumerate(cands)]

        monkeypatch.setattr(tactics, "time_tactics", fake_time)
        build = BuildConfig(max_batch_size=64, max_seq_len=1024, max_num_tokens=2048,
                            tokens_per_block=64, pdl=on, target="sm_90")  # fmt: skip
        tactic_select.timed_choices(LLAMA_3_1_8B, build, skip=skip)
        names = {n for n, *_ in seen}
        assert {"gemm", "fp8_gemm", "w4a16_gemm", "fp8_swiglu_gemm", "rms_norm"} <= names
        assert {r for n, r, *_ in seen if n == "w4a16_gemm"} == {1, 8, 16, 64, 512}
        for name, rows, pdl, _ in seen:
            assert pdl == (on and rows <= 8), (name, rows, pdl)
        before = {g: [p for n, r, _, p in seen if n == g and r == 1]
                  for g in ("gemm", "fp8_gemm", "w4a16_gemm")}  # fmt: skip
        norm, att = "add_rms_norm", "attention"
        want = {"gemm": [norm, att, norm, "swiglu", norm],
                "fp8_gemm": ["rms_norm_quant_fp8", att, "rms_norm_quant_fp8", "swiglu_quant_fp8"],
                "w4a16_gemm": [norm, att, norm, None]}  # fmt: skip
        no_pred = {g: [None] * len(w) for g, w in want.items()}
        assert before == (want if on else no_pred), before


def test_candidates_first_run_side_by_side_before_any_is_timed(monkeypatch):
    """The first calls (where Triton compiles) all start before the first timing, on several
    threads at once when allowed; INGOT_COMPILE_THREADS=1 runs them in turn on this thread."""
    import threading

    monkeypatch.setattr(tactics, "_median_ms", _fake_timer)
    for threads, expect_parallel in (("4", True), ("1", False)):
        monkeypatch.setenv("INGOT_COMPILE_THREADS", threads)
        calls, barrier = [], threading.Barrier(4, timeout=10)

        def factory(t, calls=calls, barrier=barrier, parallel=expect_parallel):
            def fn():
                calls.append((t.name, threading.current_thread() is threading.main_thread()))
                if parallel and len(calls) <= 4:
                    try:  # all four first calls run at once, or this times out
                        barrier.wait()
                    except threading.BrokenBarrierError:
                        calls.append(("barrier broken", False))

            return fn

        cands = [Tactic(f"t{i}") for i in range(4)]
        res = time_tactics("op", cands, lambda: ((), {}), factory=factory)
        assert [ms for _, ms in res] == [1.0] * 4
        assert ("barrier broken", False) not in calls
        first = calls[:4]
        assert sorted(n for n, _ in first) == ["t0", "t1", "t2", "t3"]
        assert all(not main for _, main in first) if expect_parallel else all(m for _, m in first)
        assert [n for n, _ in calls[4:]] == ["t0", "t1", "t2", "t3"]  # then timed in order


def test_compile_threads_setting_is_checked(monkeypatch):
    from ingot.plugins.compile_threads import compile_threads, map_in_threads
    from ingot.runtime.errors import ConfigError

    monkeypatch.setenv("INGOT_COMPILE_THREADS", "3")
    assert compile_threads() == 3
    assert map_in_threads(lambda x: x * x, range(10)) == [x * x for x in range(10)]
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("INGOT_COMPILE_THREADS", bad)
        with pytest.raises(ConfigError, match="INGOT_COMPILE_THREADS"):
            compile_threads()
    monkeypatch.delenv("INGOT_COMPILE_THREADS")
    assert compile_threads() >= 1


def test_decode_tactic_is_picked_over_both_context_lengths():
    # the H200's decode attention times (µs per layer) at ~200 and 2,048 keys: the fastest at
    # 2,048 keys loses 14% at short contexts and wins 3% at long ones
    a, b, broken = Tactic("p128"), Tactic("p256"), Tactic("oom")
    inf = float("inf")
    by_ctx = {256: [(a, 3.6), (b, 4.1), (broken, inf)], 2048: [(b, 12.28), (a, 12.71)]}
    best, record = pick_over_contexts(by_ctx)
    assert best is a
    assert ("p256@ctx2048", 12.28) in [(t.name, ms) for t, ms in record]
    assert len(record) == 5
    # one context length (a short max_seq_len): simply the fastest there
    assert pick_over_contexts({256: [(b, 2.0), (a, 3.0)]})[0] is b


def test_padding_rows_of_a_large_batch_timing_shape_hold_one_token():
    args, _ = _Shapes(LLAMA_3_1_8B, BUILD, device="cpu").decode_batch(40, 100, True, real=35)
    assert args[4].tolist() == [100] * 35 + [1] * 5


def test_large_batch_decode_tactic_is_picked_over_a_middle_and_a_padded_full_batch(monkeypatch):
    """An engine of up to 512 sequences times its large-batch decode tactics at 128 x 1,024
    keys, at a 512-row bucket holding 448 sequences of 2,048 keys and at 512 x 256 keys (the
    128/128 decode steps), and keeps the one with the lowest sum of relative times: the fastest
    at the middle batch alone (one split for the padded bucket) is not it when it loses more at
    the full one, nor is the best of those two when it loses most at short contexts."""
    from ingot.compiler import tactic_select
    from ingot.plugins import all_specs

    shapes_seen = []
    t4096 = next(t for t in dec.DECODE_TACTICS if t.name == "p128_n32_w1_s3_t4096")
    t8192 = next(t for t in dec.DECODE_TACTICS if t.name == "p256_n32_w1_s3_t8192_m256")
    t2048 = next(t for t in dec.DECODE_TACTICS if t.name == "p128_n32_w2_s3_t2048")

    def fake_time(name, cands, inputs, factory=None, repeats=None, before=None, **_):
        # the large-batch inputs' (batch, real, ctx), read without building them (no GPU)
        cell = (inputs.__defaults__ or (None,))[0]
        if factory is not make_decode_attention or not isinstance(cell, tuple):
            return [(c, 1.0 + i) for i, c in enumerate(cands)]
        shapes_seen.append(cell)
        i = {1024: 0, 2048: 1, 256: 2}[cell[2]]  # middle, padded full, full at short contexts
        times = {t4096.name: (1.0, 1.30, 1.0)[i], t8192.name: (1.05, 1.0, 1.40)[i],
                 t2048.name: (1.02, 1.05, 1.05)[i]}  # fmt: skip
        return sorted(((c, times.get(c.name, 2.0)) for c in cands), key=lambda r: r[1])

    monkeypatch.setattr(tactics, "time_tactics", fake_time)
    build = BuildConfig(
        max_batch_size=512, max_seq_len=4096, max_num_tokens=8192, tokens_per_block=32
    )
    skip = frozenset(s.name for s in all_specs() if s.name != "paged_attention")
    (choice,) = tactic_select.timed_choices(LLAMA_3_1_8B, build, skip=skip, kv_fp8=True)
    assert set(shapes_seen) == {(128, None, 1024), (512, 448, 2048), (512, None, 256)}
    # sums of relative times: t2048 3.12, t4096 3.30, t8192 3.45 (without the short point
    # t8192 would win, 2.05 against 2.07)
    assert f"+large:{t2048.name}" in choice.tactic
    assert f"{t8192.name}@b512_ctx256" in choice.timings_ms
    assert f"{t4096.name}@b512r448_ctx2048" in choice.timings_ms


def test_a_candidate_off_the_reference_is_never_chosen(monkeypatch):
    """time_tactics(reference=...): a candidate whose first output is off the plain-torch op
    (a kernel computing the wrong thing on the build GPU) is reported as inf with a warning,
    however fast; every candidate off it stops the build."""
    from ingot.plugins.quant import reference as qref

    monkeypatch.setattr(tactics, "_median_ms", lambda fn, repeats, before=None: 1.0)
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (64, 256))
    args = (torch.randn(1, 256), qref.pack_w4_engine(codes), torch.rand(64, 2) * 0.02 + 0.002,
            None, 128)  # fmt: skip
    good, close, wrong, broken = Tactic("good"), Tactic("close"), Tactic("wrong"), Tactic("nan")

    def factory(t):
        def fn(x, qweight, scales, pqs, group):
            y = qref.w4a16_linear(x, qweight, scales, pqs, group)
            if t is close:  # within the tolerance: kept
                return y * (1 + 1e-3)
            if t is wrong:  # e.g. a half word paired with the wrong activations
                return qref.w4a16_linear(x.roll(1, dims=1), qweight, scales, pqs, group)
            return y.fill_(float("nan")) if t is broken else y

        return fn

    with pytest.warns(UserWarning, match=r"w4a16_gemm: not used.*wrong \(.*nan \(inf\)"):
        res = time_tactics("w4a16_gemm", [wrong, good, broken, close], lambda: (args, {}),
                           factory=factory, reference=qref.w4a16_linear)  # fmt: skip
    assert dict(res) == {good: 1.0, close: 1.0, wrong: float("inf"), broken: float("inf")}
    assert res[0][0] in (good, close)
    with (
        pytest.warns(UserWarning),
        pytest.raises(RuntimeError, match="no w4a16_gemm tactic ran: wrong output"),
    ):
        time_tactics("w4a16_gemm", [wrong], lambda: (args, {}), factory=factory,
                     reference=qref.w4a16_linear)  # fmt: skip


def test_gpu_builds_check_every_gemm_site_against_its_reference():
    """Each GEMM plugin the build times per site has its plain-torch implementation and a bound."""
    from ingot.compiler.tactic_select import GEMM_TOL
    from ingot.plugins.registry import get_spec, import_attr

    for name, tol in GEMM_TOL.items():
        assert callable(import_attr(get_spec(name).impls["cpu"])(None)) and 0 < tol <= 5e-2


def test_int4_gemv_and_gemm_halves_are_timed_where_they_run(monkeypatch):
    """A w4a16_gemm tactic pairs a GEMV (decode) and a GEMM (prefill) half: the build times
    the GEMV candidates at batch 1 and the GEMM ones at a prefill-sized batch, per site, and
    keeps the fastest of each (timed together at batch 1, the GEMM half was a tie). The down
    projection's GEMV half is timed on [gate | up] with gated=True, as every INT4 engine runs
    it. With decode batches past the GEMV's one row, the small-batch candidates (the pair, and
    the pair with each tensor-core GEMV for 2-8 rows) are timed at the largest such batch
    (8), gated for down; with max_batch_size 1 they are not. With batches past 8, the
    medium-batch (split-K) candidates, on top of the chosen small half or none, are timed at
    16 and 64 rows (up to max_batch_size), gated for down, and the least total kept."""
    from ingot.compiler import tactic_select
    from ingot.plugins import all_specs
    from ingot.plugins.quant import triton_w4a16 as tw

    init = tactic_select._Shapes.__init__
    monkeypatch.setattr(tactic_select._Shapes, "__init__",
                        lambda self, m, b, device="cuda": init(self, m, b, "meta"))  # fmt: skip

    def run(max_batch_size: int, small_best: int = 2):
        calls, gemv_inputs, mid_cands = [], [], []

        def fake_time(name, cands, inputs, factory=None, repeats=None, before=None, **check):
            assert name == "w4a16_gemm" and check["tolerance"] == 1e-2
            small = any("+small_" in c.name for c in cands)
            kind = "small" if small else len({c.name.split("+")[1] for c in cands}) > 1
            kind = "mid" if any("+mid_" in c.name for c in cands) else kind
            calls.append(kind)
            mid_cands.extend(cands if kind == "mid" else [])
            if kind is not True:
                args, kw = inputs()
                gemv_inputs.append((kind, tuple(args[0].shape), args[1].shape[0], kw))
            # GEMM 2, GEMV 3, small `small_best` fastest; mid: 2 at 16 rows, 6 at 64, so 4
            # least in total (neither batch's fastest)
            if kind == "mid":
                best = 2 if inputs()[0][0].shape[0] == 16 else 6
                return sorted(((c, 1.0 + (i - best) ** 2) for i, c in enumerate(cands)),
                              key=lambda r: r[1])  # fmt: skip
            best = {True: 2, False: 3, "small": small_best}[kind]
            return sorted(((c, 1.0 + abs(i - best)) for i, c in enumerate(cands)),
                          key=lambda r: r[1])  # fmt: skip

        monkeypatch.setattr(tactics, "time_tactics", fake_time)
        build = BuildConfig(max_batch_size=max_batch_size, max_seq_len=1024,
                            max_num_tokens=2048, tokens_per_block=64, pdl=False)  # fmt: skip
        skip = frozenset(s.name for s in all_specs() if s.name != "w4a16_gemm")
        choices = tactic_select.timed_choices(LLAMA_3_1_8B, build, skip=skip)
        sites = {c.site: c for c in choices if c.site is not None}
        assert set(sites) == {"attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"}
        return calls, gemv_inputs, sites, mid_cands

    m = LLAMA_3_1_8B
    inputs = lambda rows: [  # noqa: E731
        ((rows, m.hidden_size), m.qkv_size, {}), ((rows, m.q_size), m.hidden_size, {}),
        ((rows, m.hidden_size), 2 * m.intermediate_size, {}),
        ((rows, 2 * m.intermediate_size), m.hidden_size, {"gated": True}),
    ]  # fmt: skip
    dec, mm = tw.DECODE_TACTICS[3], tw.GEMM_TACTICS[2]
    calls, gemv_inputs, sites, _ = run(8)
    assert calls == [False, True, "small"] * 4
    timed = lambda kind: sorted((g[1:] for g in gemv_inputs if g[0] == kind), key=str)  # noqa: E731
    assert timed(False) == sorted(inputs(1), key=str)
    assert timed("small") == sorted(inputs(8), key=str)
    want = tw.combine_tactics(dec, mm, tw.SMALL_TACTICS[1])  # candidate 2: after the pair
    for c in sites.values():
        assert (c.tactic, c.params) == (want.name, want.as_dict())
        assert f"{tw.combine_tactics(dec, tw.GEMM_TACTICS[0]).name}@b1" in c.timings_ms
        assert f"{tw.combine_tactics(tw.DECODE_TACTICS[0], mm).name}@rows512" in c.timings_ms
        assert f"{tw.combine_tactics(dec, mm).name}@rows8" in c.timings_ms
    calls, gemv_inputs, sites, _ = run(1)
    assert calls == [False, True] * 4
    want = tw.combine_tactics(dec, mm)
    assert {(c.tactic, tuple(sorted(c.params.items()))) for c in sites.values()} == {
        (want.name, tuple(sorted(want.as_dict().items())))
    }
    # batches up to 512: the mid half timed at 16 and 64 rows on top of the small half chosen
    calls, gemv_inputs, sites, mids = run(512)
    assert calls == [False, True, "small", "mid", "mid"] * 4
    assert timed("mid") == sorted(inputs(16) + inputs(64), key=str)
    small = tw.SMALL_TACTICS[1]
    assert mids[: 1 + len(tw.MID_TACTICS)] == [tw.combine_tactics(dec, mm, small)] + [
        tw.combine_tactics(dec, mm, small, m) for m in tw.MID_TACTICS
    ]
    want = tw.combine_tactics(dec, mm, small, tw.MID_TACTICS[3])
    for c in sites.values():
        assert (c.tactic, c.params) == (want.name, want.as_dict())
        for r in (16, 64):
            assert f"{tw.combine_tactics(dec, mm, small).name}@rows{r}" in c.timings_ms
    # the small half loses (the pair is fastest at 8 rows): the mid half alone, from 2 rows,
    # timed at the batches up to max_batch_size (here 16 once)
    calls, gemv_inputs, sites, mids = run(16, small_best=0)
    assert calls == [False, True, "small", "mid"] * 4
    assert timed("mid") == sorted(inputs(16), key=str)
    assert mids[1] == tw.combine_tactics(dec, mm, None, tw.MID_TACTICS[0])
    want = tw.combine_tactics(dec, mm, None, tw.MID_TACTICS[1])
    assert {c.tactic for c in sites.values()} == {want.name}


def test_a_reference_that_cannot_run_leaves_the_candidates_unchecked(monkeypatch):
    """A failing reference op warns and the timing goes on (the check guards the build)."""
    monkeypatch.setattr(tactics, "_median_ms", lambda fn, repeats, before=None: 1.0)
    a, b = Tactic("a"), Tactic("b")

    def broken_reference(x):
        raise RuntimeError("no kernel for this dtype")

    with pytest.warns(UserWarning, match="op: candidates not checked, the reference failed"):
        res = time_tactics("op", [a, b], lambda: ((1,), {}), factory=lambda t: lambda x: x,
                           reference=broken_reference)  # fmt: skip
    assert dict(res) == {a: 1.0, b: 1.0}


@pytest.mark.parametrize(
    "name,gemm", [("qkv_rope_gemm", "gemm"), ("fp8_qkv_rope_gemm", "fp8_gemm")]
)
def test_qkv_rope_plugins_run_their_gemms_attn_qkv_tactic(name, gemm):
    """The QKV GEMVs with RoPE in their epilogue are not timed: each runs the tactic its GEMM
    plugin timed fastest at attn.qkv when that is a GEMV, else its own default GEMV (the
    BF16 one never takes the FP8 plugin's choice, nor the FP8 one the BF16's)."""
    from ingot.compiler.tactic_select import _choice, qkv_rope_choice
    from ingot.plugins import get_spec

    spec = get_spec(name)
    gemv = spec.candidates("cuda")[-1]
    assert gemv != spec.default_tactic("cuda")
    other = "gemm" if gemm == "fp8_gemm" else "fp8_gemm"
    choices = [_choice(gemm, gemv, "attn.qkv"), _choice(other, gemv, "attn.qkv")]
    assert qkv_rope_choice(choices, name).tactic == gemv.name
    library = next(t for t in get_spec(gemm).candidates("cuda") if not t.as_dict().get("max_m"))
    choices = [_choice(gemm, library, "attn.qkv"), _choice(other, gemv, "attn.qkv")]
    assert qkv_rope_choice(choices, name).tactic == spec.default_tactic("cuda").name


def test_int4_qkv_rope_runs_the_w4a16_pair_timed_at_attn_qkv():
    """The W4A16 QKV-RoPE plugin takes the attn.qkv w4a16_gemm pair as timed (any GEMV half
    with any GEMM half, not only the pairs its candidate list spells), except a GEMV of one
    row a program (no whole RoPE pairs): then its default."""
    from ingot.compiler.tactic_select import _choice, qkv_rope_choice
    from ingot.plugins.quant import triton_w4a16 as tw

    name = "w4a16_qkv_rope_gemm"
    dec = [t for t in tw.DECODE_TACTICS if t.as_dict().get("packed")][-1]  # not the first
    pair = tw.combine_tactics(dec, tw.GEMM_TACTICS[-1])
    assert pair.name not in {t.name for t in tw.W4A16_TACTICS}
    got = qkv_rope_choice([_choice("w4a16_gemm", pair, "attn.qkv")], name)
    assert (got.tactic, got.params) == (pair.name, pair.as_dict())
    one_row = next(t for t in tw.DECODE_TACTICS if t.as_dict()["block_n"] == 1)
    pair = tw.combine_tactics(one_row, tw.GEMM_TACTICS[0])
    got = qkv_rope_choice([_choice("w4a16_gemm", pair, "attn.qkv")], name)
    assert got.tactic == tw.W4A16_TACTICS[0].name


def _timed(name, site, timings):
    from ingot.runtime.engine import PluginChoice

    best = min(timings, key=timings.get)
    return PluginChoice(name, 1, best, None, site, timings)


@pytest.mark.parametrize(
    "fused,act,down,want",
    [
        # the H100 FP8 engine's timings (ms): the two kernels beat every fused GEMV
        ({"gemv_n8_k2048_w4_s1": 0.0348, "cublaslt_qb512_w2": 0.0334}, 0.0022, 0.0240,
         "cublaslt_qb512_w2"),
        # a fused GEMV faster than the two: it runs, though a fused cuBLASLt timed faster
        ({"gemv_n8_k2048_w4_s1": 0.0240, "cublaslt_qb512_w2": 0.0200}, 0.0022, 0.0240,
         "gemv_n8_k2048_w4_s1"),
        # no tactic without a GEMV among the timed: the fastest fused GEMV stays
        ({"gemv_n8_k2048_w4_s1": 0.0348, "gemv_n4_k2048_w4_s1_u2": 0.0462}, 0.0022, 0.0240,
         "gemv_n8_k2048_w4_s1"),
    ],
)  # fmt: skip
def test_a_fused_down_projection_keeps_a_gemv_only_where_it_beats_the_two_kernels(
    fused, act, down, want
):
    """unfused_if_faster: the fused op's tactic has a GEMV exactly when its fastest GEMV beat
    the activation kernel plus the plain GEMM at mlp.down (the decoder then runs the fused
    op), else it is the fastest without one (the decoder runs the two); the sum is recorded."""
    from ingot.compiler.tactic_select import unfused_if_faster
    from ingot.plugins.quant.cuda_fp8 import make_fp8_swiglu_linear
    from ingot.runtime.model import _fused_gemv

    choices = [
        _timed("fp8_swiglu_gemm", None, fused),
        _timed("swiglu_quant_fp8", None, {"b2048_w8": act, "b512_w2": act * 2}),
        _timed("fp8_gemm", "mlp.down", {"gemv_n8_k2048_w4_s1": down, "cublaslt_qb1024_w4": 0.03}),
        _timed("fp8_gemm", "attn.o", {"gemv_n2_k4096_w8_s1": 0.001}),
    ]
    out = unfused_if_faster(choices)
    assert out[1:] == choices[1:]
    (c,) = [c for c in out if c.name == "fp8_swiglu_gemm"]
    assert c.tactic == want and (not c.params.get("max_m")) == want.startswith("cublas")
    assert c.timings_ms["unfused"] == pytest.approx(act + down)
    fn = make_fp8_swiglu_linear(Tactic(c.tactic, tuple(c.params.items())))
    assert (_fused_gemv(fn) is None) == want.startswith("cublas")


def test_only_a_fused_op_with_no_gemv_rows_is_dropped():
    """_fused_gemv: a fused op is run unless its tactic has no GEMV at all (gemv_rows 0); one
    with no such attribute (the CPU reference ops) is always run."""
    from ingot.plugins.gemm.cuda import GEMM_TACTICS, make_swiglu_linear
    from ingot.plugins.gemm.reference import make_swiglu_linear as ref_swiglu_linear
    from ingot.runtime.model import _fused_gemv

    for t in GEMM_TACTICS:
        fn = make_swiglu_linear(t)
        assert (_fused_gemv(fn) is None) == (int(t.as_dict().get("max_m", 0)) == 0)
    assert _fused_gemv(ref_swiglu_linear(None)) is not None


def test_int4_down_projection_also_times_each_gemv_with_swiglu_apart(monkeypatch):
    """At mlp.down (gated: [gate | up] in) the decode candidates are every decode tactic and
    each non-tensor-core one's `swiglu_apart` twin (SwiGLU by its kernel first); the other
    sites time the decode tactics alone. A twin timed fastest is what the down site keeps."""
    from ingot.compiler import tactic_select
    from ingot.plugins import all_specs
    from ingot.plugins.quant import triton_w4a16 as tw

    init = tactic_select._Shapes.__init__
    monkeypatch.setattr(tactic_select._Shapes, "__init__",
                        lambda self, m, b, device="cuda": init(self, m, b, "meta"))  # fmt: skip
    twins = [tw.swiglu_apart(d) for d in tw.DECODE_TACTICS if not d.as_dict().get("mma")]
    dec_lists = []

    def fake_time(name, cands, inputs, factory=None, repeats=None, before=None, **_):
        decs = {c.name.split("+")[0] for c in cands}
        if len(decs) > 1 and all("+mid_" not in c.name and "+small_" not in c.name for c in cands):
            dec_lists.append(([c.name.split("+")[0] for c in cands], inputs()[1].get("gated")))
            fast = twins[1].name  # the second twin is fastest wherever it is a candidate
            return sorted(((c, 0.5 if c.name.startswith(fast + "+") else 1.0) for c in cands),
                          key=lambda r: r[1])  # fmt: skip
        return [(c, 1.0 + i) for i, c in enumerate(cands)]

    monkeypatch.setattr(tactics, "time_tactics", fake_time)
    build = BuildConfig(max_batch_size=1, max_seq_len=1024, max_num_tokens=2048,
                        tokens_per_block=64, pdl=False)  # fmt: skip
    skip = frozenset(s.name for s in all_specs() if s.name != "w4a16_gemm")
    sites = {c.site: c for c in tactic_select.timed_choices(LLAMA_3_1_8B, build, skip=skip)
             if c.site}  # fmt: skip
    plain = [d.name for d in tw.DECODE_TACTICS]
    assert sorted(dec_lists, key=lambda r: bool(r[1])) == [(plain, None)] * 3 + [
        (plain + [t.name for t in twins], True)
    ]
    assert sites["mlp.down"].params["dec_swiglu_apart"] == 1
    assert sites["mlp.down"].tactic.startswith(twins[1].name + "+")
    assert all(
        "dec_swiglu_apart" not in sites[s].params for s in ("attn.qkv", "attn.o", "mlp.gate_up")
    )
