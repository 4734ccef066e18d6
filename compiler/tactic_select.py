"""Tactic selection: time each plugin's candidate tactics on the target GPU at the engine's
shapes and keep the fastest; without that GPU (cross-build), take each plugin's default.

Decode is the hot path, so ops are timed at decode shapes (one token), except prefill
attention, timed on one max-size chunk. GEMMs are chosen per use site (their shapes differ).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ingot.plugins import Tactic, all_specs, get_spec, target_kind
from ingot.plugins.attention.layout import to_v_layout
from ingot.plugins.registry import import_attr
from ingot.runtime.config import BuildConfig, ModelConfig
from ingot.runtime.engine import PluginChoice

Progress = Callable[[str, int, int], None]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# how far (relative error) a GEMM tactic's output may be from the plain-torch op's before the
# build rejects it: bf16 and W4A16 rounding; FP8 (the kernel tests' bounds)
GEMM_TOL = {"gemm": 1e-2, "w4a16_gemm": 1e-2, "fp8_gemm": 5e-2}


def specs_for(kind: str) -> list:
    """The registered plugins that have an implementation for `kind` ("cpu" or "cuda")."""
    return [s for s in all_specs() if kind in s.impls]


def gemm_sites(m: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """Use site -> (N, K, has_bias) of every GEMM the decoder runs."""
    return {
        "attn.qkv": (m.qkv_size, m.hidden_size, m.qkv_bias),
        "attn.o": (m.hidden_size, m.q_size, False),
        "mlp.gate_up": (2 * m.intermediate_size, m.hidden_size, False),
        "mlp.down": (m.hidden_size, m.intermediate_size, False),
        "lm_head": (m.vocab_size, m.hidden_size, False),
    }


def default_choices(target: str, model: ModelConfig) -> list[PluginChoice]:
    """Every op with its default tactic (the cross-build table)."""
    kind = target_kind(target)
    out = []
    for spec in specs_for(kind):
        t = spec.default_tactic(kind)
        sites = (
            [None] + list(gemm_sites(model)) if spec.name == "gemm" and kind == "cuda" else [None]
        )
        for site in sites:
            out.append(_choice(spec.name, t, site))
    return out


def _choice(
    name: str,
    tactic: Tactic | None,
    site: str | None = None,
    timings: list[tuple[Tactic, float]] | None = None,
) -> PluginChoice:
    spec = get_spec(name)
    return PluginChoice(
        name,
        spec.version,
        tactic.name if tactic else None,
        tactic.as_dict() if tactic else None,
        site,
        {t.name: round(ms, 5) for t, ms in timings} if timings else None,
    )


class _Shapes:
    """Random inputs at the engine's shapes, on the GPU."""

    def __init__(self, m: ModelConfig, b: BuildConfig, device: str = "cuda") -> None:
        self.m, self.b = m, b
        self.dt = _DTYPES[m.dtype]
        self.dev = torch.device(device)

    def t(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype or self.dt, device=self.dev)

    def _paged(self, batch: int, n_q: int, ctx: int, kv_fp8: bool = False):
        """`batch` sequences of ctx tokens whose last n_q are queried, in a paged cache of the
        engine's block size (FP8 with unit scales if kv_fp8): paged_attention's args and the
        scale kwargs."""
        m, bs = self.m, self.b.tokens_per_block
        blocks = -(-ctx // bs)
        shape = (batch * blocks + 1, bs, m.num_kv_heads, m.head_dim)
        kc, vc = self.t(*shape), self.t(*shape)
        kw: dict[str, Any] = {}
        if kv_fp8:
            # V transposed per block, as the engine's FP8 pool stores it
            kc, vc = kc.to(torch.float8_e4m3fn), to_v_layout(vc.to(torch.float8_e4m3fn))
            one = torch.ones((), dtype=torch.float32, device=self.dev)
            kw = {"k_scale": one, "v_scale": one}
        width = -(-self.b.max_seq_len // bs)
        tables = torch.zeros(batch, width, dtype=torch.int32, device=self.dev)
        perm = torch.randperm(batch * blocks, device=self.dev).int()
        tables[:, :blocks] = perm.view(batch, blocks)
        i32 = dict(dtype=torch.int32, device=self.dev)
        args = (
            self.t(batch * n_q, m.num_heads, m.head_dim),
            kc,
            vc,
            tables,
            torch.full((batch,), ctx, **i32),
            torch.arange(batch + 1, **i32) * n_q,
            m.head_dim**-0.5,
            m.sliding_window,
        )
        return args, kw

    def decode_batch(
        self, batch: int, ctx: int, kv_fp8: bool, real: int | None = None
    ) -> tuple[tuple[Any, ...], dict]:
        """`batch` sequences of ctx tokens, one query each (the decode kernel's inputs), with
        the engine's KV cache dtype. real: only the first `real` rows hold ctx tokens, the
        others one (a decode graph's bucket filled in part: its padding rows)."""
        args, kw = self._paged(batch, 1, ctx, kv_fp8)
        if real is not None:
            args[4][real:] = 1
        return args, kw | {"max_context_len": self.b.max_seq_len}

    def prompts(self, batch: int, n: int, kv_fp8: bool = False):
        """`batch` whole prompts of n tokens each (the prefill kernel's inputs)."""
        args, kw = self._paged(batch, n, n, kv_fp8)
        return args, kw | {"max_query_len": n}

    def attention(
        self, n_q: int, ctx: int, kv_fp8: bool = False, bound: int | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One sequence: n_q queries (1: the decode kernel's inputs, else the prefill
        kernel's) ending a context of ctx tokens, with the engine's KV cache dtype. bound:
        the decode launch's context bound (the decode graphs': max_seq_len unless given)."""
        args, kw = self._paged(1, n_q, ctx, kv_fp8)
        # NOTE: each kernel takes only its own bound (a stray kwarg made every candidate fail)
        if n_q == 1:
            return args, kw | {"max_context_len": bound or self.b.max_seq_len}
        return args, kw | {"max_query_len": n_q}

    def op(self, name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        m, d = self.m, self.m.hidden_size
        if name == "rms_norm":
            return (self.t(1, d), self.t(d), m.rms_norm_eps), {}
        if name == "add_rms_norm":
            return (self.t(1, d), self.t(1, d), self.t(d), m.rms_norm_eps), {}
        if name == "swiglu":
            return (self.t(1, 2 * m.intermediate_size),), {}
        if name == "rope":
            n = self.b.max_seq_len
            return (
                self.t(1, m.num_heads, m.head_dim),
                self.t(1, m.num_kv_heads, m.head_dim),
                torch.zeros(1, dtype=torch.int32, device=self.dev),
                self.t(n, m.head_dim, dtype=torch.float32),
                self.t(n, m.head_dim, dtype=torch.float32),
            ), {}
        if name == "rms_norm_quant_fp8":
            scale = torch.tensor(0.05, dtype=torch.float32, device=self.dev)
            return (self.t(1, d), self.t(d), m.rms_norm_eps, scale), {}
        if name == "fp8_swiglu_gemm":
            f32 = dict(dtype=torch.float32, device=self.dev)
            i = m.intermediate_size
            w = (self.t(d, i) * 0.1).to(torch.float8_e4m3fn)
            scales = (torch.tensor(0.01, **f32), torch.tensor(0.02, **f32))
            return (self.t(1, 2 * i), w, *scales, None), {"out_dtype": self.dt}
        if name == "swiglu_quant_fp8":
            scale = torch.tensor(0.05, dtype=torch.float32, device=self.dev)
            return (self.t(1, 2 * m.intermediate_size), scale), {}
        if name == "swiglu_gemm":
            i = m.intermediate_size
            return (self.t(1, 2 * i), self.t(d, i), None), {}
        if name == "rope_kv_write":
            (q, k, pos, cos, sin), _ = self.op("rope")
            (_, v, kc, vc, slots), _ = self.op("kv_cache_write")
            return (q, k, v, pos, cos, sin, kc, vc, slots), {}
        if name == "kv_cache_write":
            bs = self.b.tokens_per_block
            return (
                self.t(1, m.num_kv_heads, m.head_dim),
                self.t(1, m.num_kv_heads, m.head_dim),
                self.t(4, bs, m.num_kv_heads, m.head_dim),
                self.t(4, bs, m.num_kv_heads, m.head_dim),
                torch.tensor([bs + 1], dtype=torch.int32, device=self.dev),
            ), {}
        raise KeyError(name)

    def gemm(self, n: int, k: int, bias: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.t(1, k), self.t(n, k), self.t(n) if bias else None), {}

    def fp8_gemm(self, n: int, k: int, bias: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """x arrives quantized, as the fused norm / SwiGLU kernels before the GEMM give it."""
        f32 = dict(dtype=torch.float32, device=self.dev)
        w = (self.t(n, k) * 0.1).to(torch.float8_e4m3fn)
        x = (self.t(1, k) * 0.1).to(torch.float8_e4m3fn)
        b = self.t(n) if bias else None
        scales = (torch.tensor(0.01, **f32), torch.tensor(0.02, **f32))
        return (x, w, *scales, b), {"out_dtype": self.dt}

    def w4a16_gemm(
        self, n: int, k: int, bias: bool, group: int, rows: int = 1, gated: bool = False
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The engine layout: int32 words [N, K/8] (8 codes each), scales [N, K/group]; x of
        `rows` rows (1: the decode GEMV; more: the prefill GEMM). gated: x is [gate | up], as
        the down projection's decode GEMV takes it (SwiGLU applied as it loads, or before)."""
        words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=self.dev)
        scales = (torch.rand(n, k // group, device=self.dev) * 0.02 + 0.002).to(self.dt)
        pqs = (torch.rand(k, device=self.dev) + 0.5).to(self.dt)
        x = self.t(rows, 2 * k if gated else k)
        kw = {"gated": True} if gated else {}
        return (x, words, scales, pqs, group, None, self.t(n) if bias else None), kw


def pick_over_contexts(
    by_ctx: dict[int | str, list[tuple[Tactic, float]]],
) -> tuple[Tactic, list[tuple[Tactic, float]]]:
    """The candidate whose times, each relative to the fastest at its context length (or
    shape, named by a str key), sum lowest; and every timing, named `tactic@ctxN` (`tactic@key`),
    for the engine's record."""
    score: dict[str, float] = {}
    tactics: dict[str, Tactic] = {}
    record = []
    for ctx, res in by_ctx.items():
        fastest = min(ms for _, ms in res)
        label = ctx if isinstance(ctx, str) else f"ctx{ctx}"
        for t, ms in res:
            tactics[t.name] = t
            score[t.name] = score.get(t.name, 0.0) + ms / fastest
            record.append((Tactic(f"{t.name}@{label}", t.params), ms))
    return tactics[min(score, key=score.__getitem__)], record


def timed_choices(
    model: ModelConfig,
    build: BuildConfig,
    progress: Progress | None = None,
    skip: frozenset[str] = frozenset(),
    group_size: int = 128,
    quant_lm_head: bool = False,
    kv_fp8: bool = False,
) -> list[PluginChoice]:
    """Time every candidate on this machine's GPU; one choice per op (per site for GEMMs,
    plain and quantized). skip: plugins the engine does not run (not timed, not returned).
    group_size: the INT4 quantization group of a w4a16_gemm engine. kv_fp8: the engine's KV
    cache is FP8 (attention is timed with one)."""
    from ingot.plugins.attention.triton_decode import (
        DECODE_TACTICS,
        LARGE_BATCH_ROWS,
        combine_tactics,
        make_decode_attention,
    )
    from ingot.plugins.attention.triton_prefill import (
        PREFILL_TACTICS,
        SHORT_PROMPT_BATCH,
        SHORT_PROMPT_TACTICS,
        make_prefill_attention,
    )
    from ingot.plugins.tactics import resolve_factory, time_tactics

    shapes = _Shapes(model, build)
    jobs: list[tuple[str, Callable[[], PluginChoice]]] = []

    def best(name, cands, inputs, factory=None, before=None, pdl=False, **check):
        res = time_tactics(name, cands, inputs, factory=factory, before=before, pdl=pdl, **check)
        return res[0][0], res

    # NOTE: what a PDL engine runs at batch 1 (its decode step) is timed as its PDL variant
    decode_pdl = build.pdl

    def simple(name: str) -> PluginChoice:
        spec = get_spec(name)
        cands = spec.candidates("cuda")
        if len(cands) <= 1:
            return _choice(name, cands[0] if cands else None)
        t, res = best(name, cands, lambda: shapes.op(name), pdl=decode_pdl)
        return _choice(name, t, None, res)

    def attention() -> PluginChoice:
        n_pf = min(2048, build.max_num_tokens, build.max_seq_len)
        # decode at a short and a long context: the fastest at 2,048 keys was 14% slower at
        # ~200 (the H200 bench, 2026-12-02)
        by_ctx = {
            ctx: time_tactics(
                "paged_attention",
                DECODE_TACTICS,
                lambda ctx=ctx: shapes.attention(1, ctx, kv_fp8),
                factory=make_decode_attention,
            )
            for ctx in sorted({min(256, build.max_seq_len), min(2048, build.max_seq_len)})
        }
        dec, r1 = pick_over_contexts(by_ctx)
        pf, r2 = best(
            "paged_attention",
            PREFILL_TACTICS,
            lambda: shapes.attention(n_pf, n_pf, kv_fp8),
            make_prefill_attention,
        )
        large, r3 = large_batch_decode()
        short, r4 = short_context_decode()
        prompts, r5 = short_prompt_prefill(pf)
        return _choice("paged_attention", combine_tactics(dec, pf, large, short, prompts), None,
                       r1 + r2 + r3 + r4 + r5)  # fmt: skip

    def short_prompt_prefill(long: Tactic) -> tuple[Tactic | None, list[tuple[Tactic, float]]]:
        """The prefill tactic of launches whose prompts have at most SHORT_PROMPT tokens,
        timed at SHORT_PROMPT_BATCH (128/128's mixed steps: 64 prompts of 128 tokens) among
        PREFILL_TACTICS and SHORT_PROMPT_TACTICS; None where the 2,048-token pick (`long`)
        is the fastest there too, or the engine never runs such a batch."""
        prompts, n = SHORT_PROMPT_BATCH
        n = min(n, build.max_seq_len)
        batch = min(prompts, build.max_num_tokens // n, build.max_batch_size)
        if batch < 2:
            return None, []
        res = time_tactics(
            "paged_attention",
            PREFILL_TACTICS + SHORT_PROMPT_TACTICS,
            lambda: shapes.prompts(batch, n, kv_fp8),
            factory=make_prefill_attention,
        )
        best = res[0][0]
        return (None if best.name == long.name else best), [
            (Tactic(f"{t.name}@{batch}x{n}", t.params), ms) for t, ms in res
        ]

    def short_context_decode() -> tuple[Tactic | None, list[tuple[Tactic, float]]]:
        """The decode tactic of launches bounded by SHORT_CONTEXT keys (the small-batch decode
        graphs' short tier), timed at 256 keys under that bound; None if every context fits
        it anyway (the main decode tactic is then timed at those contexts)."""
        from ingot.plugins.attention.layout import SHORT_CONTEXT

        if build.max_seq_len <= SHORT_CONTEXT:
            return None, []
        res = time_tactics(
            "paged_attention",
            DECODE_TACTICS,
            lambda: shapes.attention(1, min(256, SHORT_CONTEXT), kv_fp8, bound=SHORT_CONTEXT),
            factory=make_decode_attention,
        )
        return res[0][0], [(Tactic(f"{t.name}@short{SHORT_CONTEXT}", t.params), ms)
                           for t, ms in res]  # fmt: skip

    def large_batch_decode() -> tuple[Tactic | None, list[tuple[Tactic, float]]]:
        """The decode tactic of steps with >= LARGE_BATCH_ROWS sequences x kv heads, timed
        at such a batch with the engine's KV cache dtype; None if the engine never runs one."""
        batch = min(build.max_batch_size, 128)
        if batch * model.num_kv_heads < LARGE_BATCH_ROWS:
            return None, []
        # (batch, real rows, context): a middle batch; the largest bucket up to 512 filled to
        # 7/8 at a long context (its padding rows decide the split plan, as in the graphs); and
        # that bucket full at a short context, where 128/128's decode steps run: the pick of
        # the first two ran 116 us a layer in that engine on the H100, ~8% slower than the
        # fastest tactic at 512 x 192 keys in the batch stage (docs/performance.md, 12-06)
        ctx = min(1024, build.max_seq_len)
        shapes_ = {f"b{batch}_ctx{ctx}": (batch, None, ctx)}
        big = min(build.max_batch_size, 512)
        if big > batch:
            long, short = min(2048, build.max_seq_len), min(256, build.max_seq_len)
            shapes_[f"b{big}r{big * 7 // 8}_ctx{long}"] = (big, big * 7 // 8, long)
            shapes_[f"b{big}_ctx{short}"] = (big, None, short)
        by_shape = {
            key: time_tactics(
                "paged_attention",
                DECODE_TACTICS,
                lambda s=s: shapes.decode_batch(s[0], s[2], kv_fp8, s[1]),
                factory=make_decode_attention,
            )
            for key, s in shapes_.items()
        }
        return pick_over_contexts(by_shape)

    def predecessor(name: str, site: str) -> Callable[[], Any] | None:
        """What a PDL engine's batch-1 decode step runs just before the GEMM plugin `name` at
        `site` (decode attention before the o projection; a norm before qkv, gate_up and the
        lm_head, an FP8 engine's quantizing one before its qkv and gate_up; before a BF16 or
        FP8 down GEMV the SwiGLU (-quantize) kernel, which is when that GEMV runs at decode,
        `unfused_if_faster`), so the GEMV tactics are timed as they run there: loading
        weights while it runs. With decode attention taking ~5 us at batch 1, a tactic whose
        programs are all resident at once can load most of its weights before its input
        exists (plugins/pdl.py). INT4's down GEMV follows the gate_up GEMV (SwiGLU inside
        the op)."""
        if not build.pdl:
            return None
        fp8 = name == "fp8_gemm"
        if site == "attn.o":
            args, kw = shapes.attention(1, min(256, build.max_seq_len), kv_fp8)
            fn = make_decode_attention(DECODE_TACTICS[0])
            return lambda: fn(*args, **kw)
        if site in ("attn.qkv", "mlp.gate_up", "lm_head"):
            op = "rms_norm_quant_fp8" if fp8 and site != "lm_head" else "add_rms_norm"
        elif site == "mlp.down" and name in DOWN_ACTIVATION:
            op = DOWN_ACTIVATION[name]
        else:
            return None
        args, kw = shapes.op(op)
        fn = resolve_factory(op)(get_spec(op).default_tactic("cuda"))
        return lambda: fn(*args, **kw)

    def check(name: str) -> dict[str, Any]:
        """Each candidate's output is checked against the plain-torch op before it is timed."""
        return dict(reference=import_attr(get_spec(name).impls["cpu"])(None),
                    tolerance=GEMM_TOL[name])  # fmt: skip

    def gemm(name: str, site: str, inputs: Callable[[], Any]) -> PluginChoice:
        t, res = best(name, get_spec(name).candidates("cuda"), inputs, resolve_factory(name),
                      predecessor(name, site), decode_pdl, **check(name))  # fmt: skip
        return _choice(name, t, site, res)

    def w4a16(site: str, n: int, k: int, bias: bool) -> PluginChoice:
        """A W4A16 tactic is a GEMV (decode) half and a GEMM (prefill) half: each is timed
        where it runs, the GEMV at batch 1, the GEMM at a prefill-sized batch, and the engine
        runs the pair (timed together at batch 1, every pair sharing a GEMV tied); then,
        when decode batches reach past the GEMV's rows, a small-batch half for up to 8 rows
        and a medium-batch half for up to 64 (`triton_w4a16.combine_tactics`), each kept only
        if faster than what runs there without it."""
        from ingot.plugins.quant import triton_w4a16 as tw

        name = "w4a16_gemm"
        factory, rows = resolve_factory(name), min(512, build.max_num_tokens)
        # the down projection's decode GEMV takes [gate | up] in every INT4 engine: timed so,
        # as tactics differ in where SwiGLU runs (as x is loaded, or a kernel before: the
        # tensor-core ones, and each other one's `swiglu_apart` twin, timed there only)
        gated = site == "mlp.down"
        dec_cands = tw.decode_candidates(gated)
        decs = [tw.combine_tactics(d, tw.GEMM_TACTICS[0]) for d in dec_cands]
        mms = [tw.combine_tactics(tw.DECODE_TACTICS[0], m) for m in tw.GEMM_TACTICS]
        dec, r1 = best(name, decs, lambda: shapes.w4a16_gemm(n, k, bias, group_size, gated=gated),
                       factory, predecessor(name, site), decode_pdl, **check(name))  # fmt: skip
        mm, r2 = best(name, mms, lambda: shapes.w4a16_gemm(n, k, bias, group_size, rows),
                      factory, None, **check(name))  # fmt: skip
        dec, mm = dec_cands[decs.index(dec)], tw.GEMM_TACTICS[mms.index(mm)]
        pair = tw.combine_tactics(dec, mm)
        record = [(Tactic(f"{t.name}@b1", t.params), ms) for t, ms in r1]
        record += [(Tactic(f"{t.name}@rows{rows}", t.params), ms) for t, ms in r2]
        # decode batches past the GEMV's rows run the GEMM, which reads and expands the whole
        # weight for them: a small-batch half may take them up to 8, timed against the pair
        # at the largest such bucket (its worst case)
        small, sb, taken = min(tw.MMA_ROWS, build.max_batch_size), None, int(dec.as_dict()["max_m"])
        if dec.as_dict().get("mma"):
            taken = tw.MMA_ROWS
        if small > taken:
            cands = [pair] + [tw.combine_tactics(dec, mm, s) for s in tw.SMALL_TACTICS]
            pair, r3 = best(name, cands, lambda: shapes.w4a16_gemm(n, k, bias, group_size, small,
                                                                   gated=gated),
                            factory, None, decode_pdl, **check(name))  # fmt: skip
            record += [(Tactic(f"{t.name}@rows{small}", t.params), ms) for t, ms in r3]
            if pair != cands[0]:
                sb, taken = tw.SMALL_TACTICS[cands.index(pair) - 1], tw.MMA_ROWS
        # batches past those up to MID_ROWS: a split-K GEMM, timed against what runs there
        # otherwise (the GEMM half) at a small and a large such batch; the least total wins
        # (the pair on a tie)
        mids = sorted(
            {min(r, build.max_batch_size) for r in tw.MID_TIMED_ROWS} - {*range(taken + 1)}
        )
        if mids:
            cands = [pair] + [tw.combine_tactics(dec, mm, sb, m) for m in tw.MID_TACTICS]
            total = dict.fromkeys(cands, 0.0)
            for r in mids:
                _, res = best(name, cands, lambda r=r: shapes.w4a16_gemm(n, k, bias, group_size, r,
                                                                         gated=gated),
                              factory, None, **check(name))  # fmt: skip
                record += [(Tactic(f"{t.name}@rows{r}", t.params), ms) for t, ms in res]
                for t, ms in res:
                    total[t] += ms
            pair = min(cands, key=total.__getitem__)
        return _choice(name, pair, site, record)

    # the GEMM plugins, timed per use site: (site, N, K, has_bias) -> choice
    site_jobs = {
        "gemm": lambda s, n, k, b: gemm("gemm", s, lambda: shapes.gemm(n, k, b)),
        "fp8_gemm": lambda s, n, k, b: gemm("fp8_gemm", s, lambda: shapes.fp8_gemm(n, k, b)),
        "w4a16_gemm": w4a16,
    }
    # the one GEMM plugin the lm_head runs: only that one is timed at its site
    lm_head_gemm = "fp8_gemm" if quant_lm_head else "gemm"
    for spec in specs_for("cuda"):
        if spec.name in skip or spec.name in QKV_ROPE_OF:  # derived below, not timed
            continue
        if spec.name == "paged_attention":
            jobs.append(("paged_attention", attention))
        elif spec.name in site_jobs:
            name, job = spec.name, site_jobs[spec.name]
            jobs.append((name, lambda n=name: _choice(n, get_spec(n).default_tactic("cuda"))))
            for site, (n, k, bias) in gemm_sites(model).items():
                if site == "lm_head" and name != lm_head_gemm:
                    continue
                jobs.append((f"{name}@{site}", lambda j=job, s=site, a=(n, k, bias): j(s, *a)))
        else:
            jobs.append((spec.name, lambda name=spec.name: simple(name)))
    out = []
    for i, (_, job) in enumerate(jobs):
        out.append(job())
        if progress:
            progress("timing tactics", i + 1, len(jobs))
    torch.cuda.empty_cache()
    out += [qkv_rope_choice(out, name) for name in QKV_ROPE_OF if name not in skip]
    return unfused_if_faster(out)


# the down projections with the activation fused in -> (the activation op, the plain GEMM
# plugin timed at mlp.down), which decode runs instead when the fused op has no GEMV tactic
FUSED_DOWN = {
    "swiglu_gemm": ("swiglu", "gemm"),
    "fp8_swiglu_gemm": ("swiglu_quant_fp8", "fp8_gemm"),
}
# the plain GEMM plugin -> the activation kernel before it at mlp.down when run unfused
DOWN_ACTIVATION = {gemm: act for act, gemm in FUSED_DOWN.values()}


def unfused_if_faster(choices: list[PluginChoice]) -> list[PluginChoice]:
    """A fused down projection recomputes the activation in every program of its GEMV (an
    FP8 one at Llama-8B shapes: 34.8 us against 2.2 for the SwiGLU-quantize kernel plus 24.0
    for the plain FP8 GEMV, H100). The decoder runs the fused op only when its tactic has a
    GEMV (runtime/model.py `_fused_gemv`), else the activation kernel and the plain GEMM's
    own tactic at mlp.down; so the fused op keeps its fastest GEMV tactic when that beats the
    two's fastest times added up (timed at batch 1; in a PDL build the plain GEMM's time is
    what it adds after the activation kernel, `predecessor`), else its fastest tactic without
    one. The sum is kept in its timings as `unfused`."""
    by = {(c.name, c.site): c for c in choices}
    out = []
    for c in choices:
        act, gemm = FUSED_DOWN.get(c.name, (None, None))
        a, g = by.get((act, None)), by.get((gemm, "mlp.down"))
        cands = {t.name: t for t in get_spec(c.name).candidates("cuda")} if act else {}
        timed = [(cands[n], ms) for n, ms in (c.timings_ms or {}).items() if n in cands]
        if not (c.site is None and timed and a and g and a.timings_ms and g.timings_ms):
            out.append(c)
            continue
        plain = min(a.timings_ms.values()) + min(g.timings_ms.values())
        gemvs = [r for r in timed if int(r[0].as_dict().get("max_m", 0)) > 0]
        others = [r for r in timed if r not in gemvs]
        fused = min(gemvs, key=lambda r: r[1], default=None)
        keep = fused if fused and fused[1] <= plain else min(others, key=lambda r: r[1],
                                                              default=fused)  # fmt: skip
        out.append(_choice(c.name, keep[0], None, timed + [(Tactic("unfused"), plain)]))
    return out


# the QKV GEMVs with RoPE in their epilogue -> the GEMM plugin whose attn.qkv tactic they run
QKV_ROPE_OF = {
    "qkv_rope_gemm": "gemm",
    "fp8_qkv_rope_gemm": "fp8_gemm",
    "w4a16_qkv_rope_gemm": "w4a16_gemm",
}


def qkv_rope_choice(choices: list[PluginChoice], name: str = "qkv_rope_gemm") -> PluginChoice:
    """The QKV GEMV with RoPE in its epilogue runs the tactic timed fastest for the attn.qkv
    GEMM of its kind (its epilogue is a few stores; timing it again would cost the build a
    compile per tactic) when that tactic has a GEMV (a W4A16 one: its GEMV half, any pair),
    or its default GEMV tactic when cuBLAS(Lt) won there."""
    spec, gemm = get_spec(name), QKV_ROPE_OF[name]
    qkv = next((c for c in choices if c.name == gemm and c.site == "attn.qkv"), None)
    params = (qkv.params or {}) if qkv is not None else {}
    gemv = params.get("max_m") or params.get("dec_max_m")
    # a program's rows hold whole RoPE pairs: GEMVs of one row a program cannot fuse
    pairs = int(params.get("block_n", params.get("dec_block_n", 0))) >= 2
    if qkv is not None and gemv and pairs:
        return _choice(name, Tactic(qkv.tactic, tuple(sorted(params.items()))))
    return _choice(name, spec.default_tactic("cuda"))


def can_time_on(target: str) -> bool:
    """True when this machine has the target GPU, so tactics can be timed rather than assumed."""
    if target == "cpu" or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability()
    return target == f"sm_{major}{minor}"
