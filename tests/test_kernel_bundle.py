"""The AOT dry run (compiler/kernel_bundle.py) at production shapes, on the CPU: every decode
split plan the CUDA graphs use is among the recorded launches, so none compiles at load; an
engine built with programmatic dependent launch records (and compiles) its PDL variants."""

from __future__ import annotations

import pytest
import torch
from model_shapes import LLAMA_3_1_8B
from sm90 import compile_for_sm90

triton = pytest.importorskip("triton", reason="the GPU plugins are Triton kernels")

from ingot.compiler.checkpoint import expected_tensor_shapes  # noqa: E402
from ingot.compiler.kernel_bundle import engine_launches  # noqa: E402
from ingot.compiler.tactic_select import default_choices  # noqa: E402
from ingot.plugins.attention import triton_decode as dec  # noqa: E402
from ingot.plugins.gemm import cuda as gemm_cuda  # noqa: E402
from ingot.plugins.gemm import qkv_rope  # noqa: E402
from ingot.runtime.config import BuildConfig, QuantConfig  # noqa: E402
from ingot.runtime.cuda_graphs import batch_buckets  # noqa: E402
from ingot.runtime.errors import ConfigError  # noqa: E402
from ingot.runtime.model import PDL_MAX_ROWS  # noqa: E402


def binaries(specs) -> set:
    """The distinct sm_90 binaries (kernel, source, options) that launch specs compile to."""
    from triton.compiler import make_backend

    from ingot.plugins import aot

    backend = make_backend(aot.parse_target("sm_90"))
    return {
        (s.fn, src.hash(), options.hash())
        for s in specs
        for _, src, options in [aot._replay(s, backend)]
    }


def _constexpr(spec, fn, name: str):
    return spec.args[fn.arg_names.index(name)]


def _launches(b: BuildConfig, m=LLAMA_3_1_8B, choices=None) -> list:
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    choices = tuple(default_choices("sm_90", m)) if choices is None else choices
    return engine_launches(m, QuantConfig(), b, choices, shapes)


def _decode_step_launches(decoder, kv, b: BuildConfig, batches, bound=None) -> list:
    """The launches of the dry-run decoder's decode steps at these batch sizes, under a
    context bound (the decode graphs': max_seq_len unless given)."""
    from ingot.compiler import kernel_bundle as kb

    width = -(-b.max_seq_len // b.tokens_per_block)
    with kb.recorded_launches() as specs:
        for n in batches:
            meta = kb._meta_batch([1] * n, width, bound or b.max_seq_len)
            ids = torch.empty(n, dtype=torch.int32, device="meta")
            decoder.logits(decoder.forward(ids, ids, meta, kv))
    return specs


def test_dry_run_records_every_decode_split_plan():
    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=256, max_seq_len=8192, tokens_per_block=32, target="sm_90")
    specs = _launches(b)
    names = {s.fn.rsplit(":", 1)[-1] for s in specs}
    assert {"_decode_kernel", "_prefill_kernel"} <= names
    # batch-1 decode: the QKV GEMV with RoPE + KV write in its epilogue, no separate RoPE
    # launch at one row; larger steps (prefill, batch > max_m) the GEMM then the RoPE kernel
    assert {"_qkv_rope_kernel", "_rope_kernel"} <= names
    fused = [s for s in specs if s.fn.endswith(":_qkv_rope_kernel")]
    assert {_constexpr(s, qkv_rope._qkv_rope_kernel, "BLOCK_M") for s in fused} == {1}
    fn = dec._decode_kernel
    recorded = {_constexpr(s, fn, "SPLIT") for s in specs if s.fn.endswith(":_decode_kernel")}
    # what the decode graphs launch, bucket by bucket (the engine's default decode tactic)
    params = dec.DECODE_TACTICS[0].as_dict()
    wanted = {
        dec.split_plan(bs * m.num_kv_heads, b.max_seq_len, params["partition"]) > 1
        for bs in batch_buckets(b.max_batch_size)
    }
    assert wanted == {True, False}  # small batches split the context, large ones do not
    assert wanted <= recorded


@pytest.mark.parametrize("pdl", [False, True])
def test_short_context_decode_graphs_launch_bundled_binaries(pdl):
    """An engine whose attention tactic has a short-context decode tactic (other blocks and
    warps than its decode one): the decode graphs' short tier (small batches, bounded by
    SHORT_CONTEXT keys) launches that tactic's kernel, the main tier the decode tactic's, and
    the bundle holds both."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle as kb
    from ingot.plugins.attention.layout import SHORT_CONTEXT
    from ingot.runtime.cuda_graphs import SHORT_TIER_MAX_BATCH

    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=16, max_seq_len=2048, max_num_tokens=512, tokens_per_block=64,
                    target="sm_90", pdl=pdl)  # fmt: skip
    main, short = dec.DECODE_TACTICS[0], dec.DECODE_TACTICS[5]
    fn = dec._decode_kernel
    assert main.as_dict()["block_n"] != short.as_dict()["block_n"]
    from ingot.plugins.attention.triton_prefill import PREFILL_TACTICS

    tactic = dec.combine_tactics(main, PREFILL_TACTICS[0], None, short)
    choices = tuple(
        replace(c, tactic=tactic.name, params=tactic.as_dict()) if c.name == "paged_attention"
        else c
        for c in default_choices("sm_90", m)
    )  # fmt: skip
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    bundle = binaries(engine_launches(m, QuantConfig(), b, choices, shapes))
    decoder, kv = kb.dry_run_decoder(m, QuantConfig(), b, choices, shapes)
    small = [n for n in batch_buckets(b.max_batch_size) if n <= SHORT_TIER_MAX_BATCH]
    for bound, want in ((SHORT_CONTEXT, short), (b.max_seq_len, main)):
        specs = _decode_step_launches(decoder, kv, b, small, bound)
        assert binaries(specs) <= bundle
        blocks = {_constexpr(s, fn, "BLOCK_N") for s in specs if s.fn.endswith(":_decode_kernel")}
        assert blocks == {want.as_dict()["block_n"]}, (bound, blocks)


def test_pdl_engine_records_and_compiles_pdl_variants(tmp_path):
    small = dict(max_batch_size=4, max_seq_len=256, max_num_tokens=64, tokens_per_block=32)
    plain = _launches(BuildConfig(target="sm_90", **small))
    specs = _launches(BuildConfig(target="sm_90", pdl=True, **small))
    assert all(dict(s.options).get("launch_pdl") is None for s in plain)
    # every Triton kernel of the forward pass; PDL variants in decode batches of up to
    # PDL_MAX_ROWS tokens (the GEMVs' row count), the plain ones beside cuBLAS GEMMs
    assert {s.fn for s in specs} == {s.fn for s in plain}
    with_pdl = [s for s in specs if dict(s.options).get("launch_pdl") is True]
    without = {s for s in specs if dict(s.options).get("launch_pdl") is None}
    assert len(with_pdl) + len(without) == len(specs) and without <= set(plain)
    gemv_rows = {_constexpr(s, gemm_cuda._gemv_kernel, "BLOCK_M") for s in with_pdl
                 if s.fn.endswith(":_gemv_kernel")}  # fmt: skip
    assert gemv_rows and max(gemv_rows) <= PDL_MAX_ROWS
    assert {"_gemv_kernel", "_qkv_rope_kernel", "_decode_kernel", "_rms_norm_kernel"} <= {
        s.fn.rsplit(":", 1)[-1] for s in with_pdl
    }
    assert any(s.fn.endswith(":_prefill_kernel") for s in without)
    # they compile for sm_90 with the grid-dependency wait and trigger in their code
    gemv = next(s for s in specs if s.fn.endswith(":_gemv_kernel"))
    ptx = compile_for_sm90(gemv, tmp_path)
    text = ptx.asm["ptx"]
    assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text
    assert ptx.metadata.launch_pdl
    # the GEMV's first weight loads are issued before it waits for the kernel before it
    assert text.index("ld.global") < text.index("griddepcontrol.wait")


def test_pdl_needs_an_sm90_target():
    with pytest.raises(ConfigError, match="pdl needs an sm_90"):
        BuildConfig(target="cpu", pdl=True)
    with pytest.raises(ConfigError, match="pdl needs an sm_90"):
        BuildConfig(target="sm_80", pdl=True)
    assert BuildConfig(target="sm_90", pdl=True).pdl


def test_mixed_step_decodes_reuse_the_decode_graphs_binaries(monkeypatch):
    """A mixed step's decodes launch the decode kernel from sequence seq0 > 0 of the batch; the
    binary must be one the decode graphs' dry run compiles anyway (seq0 and NUM_SPLITS are not
    specialized), or a mixed step with a decode count the dry run never saw would compile at
    run time. With a large-batch decode tactic too (a timed build's choice)."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle
    from ingot.plugins.attention.triton_prefill import PREFILL_TACTICS

    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=64, max_seq_len=2048, tokens_per_block=32, target="sm_90")
    t = dec.combine_tactics(dec.DECODE_TACTICS[0], PREFILL_TACTICS[0], dec.DECODE_TACTICS[-2])
    choices = tuple(
        replace(c, tactic=t.name, params=t.as_dict()) if c.name == "paged_attention" else c
        for c in default_choices("sm_90", m)
    )
    kernels = {":_decode_kernel": dec._decode_kernel}

    def decode_specs(seq0: bool) -> list:
        """The dry run's decode launches from sequence 0, or from a later one."""
        specs = _launches(b, m, choices)
        return [
            s for s in specs for end, kernel in kernels.items()
            if s.fn.endswith(end) and bool(_constexpr(s, kernel, "seq0")) == seq0
        ]  # fmt: skip

    mixed = decode_specs(seq0=True)
    # beside one decode (small-batch tactic) and beside 63 (large-batch tactic: 1-warp programs)
    warps = {dict(s.options)["num_warps"] for s in mixed if s.fn.endswith(":_decode_kernel")}
    assert warps == {4, 1}
    # without the split only the decode graphs' batches launch the decode kernels
    monkeypatch.setattr(kernel_bundle, "trailing_decodes", lambda lens: 0)
    assert decode_specs(seq0=True) == []
    assert binaries(mixed) <= binaries(decode_specs(seq0=False))


@pytest.mark.parametrize("pdl", [False, True])
def test_steps_finishing_on_their_sampling_rows_launch_bundled_binaries(pdl):
    """Steps whose last layer finishes on the sampling rows only (model.SampleRows: many
    short prompts in one step, a long prompt, a chunk beside decodes) launch only binaries
    the engine's bundle holds. The rows' decode attention takes the decode graphs' context
    bound and PDL scope, so it runs their variants (split or not): with the step's own
    context it ran an unbundled one, compiled in the middle of a run (H200 bench, batch 64:
    9,569 -> 5,668 tok/s)."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle as kb
    from ingot.plugins.attention.triton_prefill import PREFILL_TACTICS
    from ingot.runtime.model import SampleRows

    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=64, max_seq_len=4096, max_num_tokens=8192,
                    tokens_per_block=64, target="sm_90", pdl=pdl)  # fmt: skip
    # the large-batch decode tactic a timed build picks (1-warp programs, its own target)
    t = dec.combine_tactics(dec.DECODE_TACTICS[0], PREFILL_TACTICS[0], dec.DECODE_TACTICS[-2])
    choices = tuple(
        replace(c, tactic=t.name, params=t.as_dict()) if c.name == "paged_attention" else c
        for c in default_choices("sm_90", m)
    )
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    bundle = engine_launches(m, QuantConfig(), b, choices, shapes)
    decoder, kv = kb.dry_run_decoder(m, QuantConfig(), b, choices, shapes)
    width = -(-b.max_seq_len // b.tokens_per_block)
    i32 = dict(dtype=torch.int32, device="meta")
    steps = [([128] * 64, 128), ([2048], 2048), ([300] + [1] * 5, 900), ([40] * 3 + [1], 60)]
    with kb.recorded_launches() as specs:
        for lens, ctx in steps:
            meta = kb._meta_batch(lens, width, ctx)
            ids = torch.empty(sum(lens), **i32)
            rows = SampleRows(torch.empty(len(lens), **i32), torch.empty(len(lens), **i32))
            decoder.logits(decoder.forward(ids, ids, meta, kv, rows))

    assert any(s.fn.endswith(":_decode_kernel") for s in specs)
    assert binaries(specs) <= binaries(bundle)


@pytest.mark.parametrize("pdl", [False, True])
def test_folded_norm_decode_steps_launch_bundled_binaries(pdl):
    """An engine built with fused_norms (plugins/gemm/fused_norm.py) bundles the GEMV variants
    that add into the residual stream and normalize as they load, and its batch-1 decode steps
    (folded) and larger ones (not) launch only binaries the bundle holds."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle as kb

    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=8, max_seq_len=1024, max_num_tokens=2048,
                    tokens_per_block=64, target="sm_90", pdl=pdl, fused_norms=True)  # fmt: skip
    choices = default_choices("sm_90", m)
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}

    bundle = binaries(engine_launches(m, QuantConfig(), b, choices, shapes))
    plain = binaries(engine_launches(m, QuantConfig(), replace(b, fused_norms=False), choices,
                                     shapes))  # fmt: skip
    assert plain < bundle  # the folded variants, besides all the plain ones (larger batches)
    decoder, kv = kb.dry_run_decoder(m, QuantConfig(), b, choices, shapes)
    assert decoder.fold_rows == 1
    specs = _decode_step_launches(decoder, kv, b, (1, 2, 8))
    assert binaries(specs) <= bundle
    assert binaries(specs) - plain  # the batch-1 step ran folded variants


def test_packed_w4a16_gemv_assembles_for_sm90(tmp_path):
    """The packed W4A16 GEMV (bf16x2 inline PTX) as an INT4 engine with that tactic records
    and bundles it: every packed decode tactic launches the packed kernel for bf16 x (the
    plain one, or with `persist` the resident-program one), which ptxas assembles for sm_90
    on this machine."""
    from ingot.compiler.kernel_bundle import recorded_launches
    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.quant import w4a16_persistent as wp

    N, K = 6144, 4096
    x = torch.empty(1, K, dtype=torch.bfloat16, device="meta")
    qweight = torch.empty(N, K // 8, dtype=torch.int32, device="meta")
    scales = torch.empty(N, K // 128, dtype=torch.bfloat16, device="meta")
    pqs = torch.empty(K, dtype=torch.bfloat16, device="meta")
    packed = [
        t for t in tw.DECODE_TACTICS if t.as_dict().get("packed") and not t.as_dict().get("mma")
    ]
    assert packed
    with recorded_launches() as specs:
        for t in packed:
            fn = tw.make_w4a16_linear(tw.combine_tactics(t, tw.GEMM_TACTICS[0]))
            fn(x, qweight, scales, pqs, 128)
    want = ["_w4a16_gemv_persistent_kernel" if t.as_dict().get("persist") else "_w4a16_gemv_kernel"
            for t in packed]  # fmt: skip
    assert [s.fn.rsplit(":", 1)[-1] for s in specs] == want and len(set(want)) == 2
    kernels = {"_w4a16_gemv_kernel": tw._w4a16_gemv_kernel,
               "_w4a16_gemv_persistent_kernel": wp._w4a16_gemv_persistent_kernel}  # fmt: skip
    assert all(_constexpr(s, kernels[s.fn.rsplit(":", 1)[-1]], "PACKED") for s in specs)
    for spec in (specs[0], specs[want.index("_w4a16_gemv_persistent_kernel")]):
        kernel = compile_for_sm90(spec, tmp_path)
        ptx = kernel.asm["ptx"]
        assert "sub.rn.bf16x2" in ptx and ptx.count("fma.rn.bf16x2") >= 3 * 4
        assert kernel.asm["cubin"]
    # the PDL variant (first chunk loaded before griddepcontrol.wait) assembles too
    from ingot.plugins import pdl

    with recorded_launches() as specs, pdl.scope(True):
        tw.make_w4a16_linear(tw.combine_tactics(packed[0], tw.GEMM_TACTICS[0]))(
            x, qweight, scales, pqs, 128
        )
    ptx = compile_for_sm90(specs[0], tmp_path).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "sub.rn.bf16x2" in ptx


@pytest.mark.parametrize("slab_rows", [None, 1024, 2048])
def test_w4a16_dequant_gemm_launches_one_expansion_that_assembles_for_sm90(tmp_path, slab_rows):
    """The dequantize-then-cuBLAS GEMM tactics at a prefill's rows, as the AOT dry run sees
    them: Triton launches only of the weight's expansion (the GEMM is cuBLAS's), one or one a
    slab of rows (8 and 16 MiB of bf16 at K = 4,096), which compile for sm_90, so an INT4
    engine whose build picks one bundles it."""
    from ingot.compiler.kernel_bundle import recorded_launches
    from ingot.plugins.quant import triton_w4a16 as tw

    tactic = {None: tw.DEQUANT_GEMM, 1024: tw.DEQUANT_CHUNKED[0], 2048: tw.DEQUANT_CHUNKED[1]}
    N, K = 28672, 4096
    x = torch.empty(512, K, dtype=torch.bfloat16, device="meta")
    qweight = torch.empty(N, K // 8, dtype=torch.int32, device="meta")
    scales = torch.empty(N, K // 128, dtype=torch.bfloat16, device="meta")
    pqs = torch.empty(K, dtype=torch.bfloat16, device="meta")
    fn = tw.make_w4a16_linear(tw.combine_tactics(tw.DECODE_TACTICS[0], tactic[slab_rows]))
    with recorded_launches() as specs:
        out = fn(x, qweight, scales, pqs, 128)
    assert out.shape == (512, N)
    launches = N // slab_rows if slab_rows else 1
    assert [s.fn.rsplit(":", 1)[-1] for s in specs] == ["_w4_dequant_kernel"] * launches
    assert compile_for_sm90(specs[0], tmp_path).asm["cubin"]


def test_int4_down_projection_fuses_swiglu_at_decode_sizes_only():
    """w4a16_gemm(gated=True) as the AOT dry run sees it: up to the tactic's max_m rows one
    GEMV launch applying SwiGLU as it loads [gate | up]; past them the SwiGLU kernel, then the
    GEMM; so an INT4 engine's bundle holds both (and no plain decode GEMV for the down site)."""
    from ingot.compiler.kernel_bundle import recorded_launches
    from ingot.plugins.quant import triton_w4a16 as tw

    N, K = 4096, 14336
    qweight = torch.empty(N, K // 8, dtype=torch.int32, device="meta")
    scales = torch.empty(N, K // 128, dtype=torch.bfloat16, device="meta")
    pqs = torch.empty(K, dtype=torch.bfloat16, device="meta")
    for dec_tactic in (
        next(t for t in tw.DECODE_TACTICS if "packed" not in t.as_dict()),
        next(t for t in tw.DECODE_TACTICS if "packed" in t.as_dict()),
    ):
        fn = tw.make_w4a16_linear(tw.combine_tactics(dec_tactic, tw.GEMM_TACTICS[0]))
        max_m = dec_tactic.as_dict()["max_m"]
        for T, kernels in ((max_m, ["gemv"]), (max_m + 1, ["_swiglu_kernel", "_w4a16_mm_kernel"])):
            gate_up = torch.empty(T, 2 * K, dtype=torch.bfloat16, device="meta")
            with recorded_launches() as specs:
                out = fn(gate_up, qweight, scales, pqs, 128, gated=True)
            assert out.shape == (T, N)
            names = [s.fn.rsplit(":", 1)[-1] for s in specs]
            if kernels == ["gemv"]:
                (spec,) = specs
                kernel = tw._w4a16_gemv_kernel
                assert names == [kernel.__name__]
                assert _constexpr(spec, kernel, "GATED") is True
                packed = "packed" in dec_tactic.as_dict()
                assert _constexpr(spec, kernel, "PACKED") is packed
            else:
                assert names == kernels, names


def test_int4_engine_with_folded_norms_launches_bundled_binaries():
    """An INT4 engine built with fused_norms folds its norms into the W4A16 GEMVs (qkv and
    gate_up normalize, o and down add; down with SwiGLU inside) at batch 1 and bundles those
    variants; its decode steps launch only binaries the bundle holds."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle as kb
    from ingot.compiler.quantize.layout import checkpoint_layout
    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.quant import unused_plugins

    m, q = LLAMA_3_1_8B, QuantConfig(mode="int4_awq")
    b = BuildConfig(max_batch_size=4, max_seq_len=512, max_num_tokens=256,
                    tokens_per_block=64, target="sm_90", pdl=True, fused_norms=True)  # fmt: skip
    st = {"I32": torch.int32, "BF16": torch.bfloat16, "F32": torch.float32}
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: (s, st[d]) for n, (s, d) in checkpoint_layout(m, q).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    unused = unused_plugins(q.mode)
    choices = tuple(c for c in default_choices("sm_90", m) if c.name not in unused)
    bundle = kb.engine_launches(m, q, b, choices, shapes)
    plain = kb.engine_launches(m, q, replace(b, fused_norms=False), choices, shapes)
    decoder, kv = kb.dry_run_decoder(m, q, b, choices, shapes)
    assert decoder.fold_rows == tw._split_params(None)[0]["max_m"] == 1
    fn = tw._w4a16_gemv_kernel
    variants = {(_constexpr(s, fn, "NORM"), _constexpr(s, fn, "ADD_OUT"), _constexpr(s, fn, "GATED"))
                for s in bundle if s.fn.endswith(":_w4a16_gemv_kernel")}  # fmt: skip
    # qkv / gate_up normalize, o adds, down adds with SwiGLU inside; the last layer plain
    assert {(True, False, False), (False, True, False), (False, True, True),
            (False, False, False), (False, False, True)} <= variants  # fmt: skip
    assert binaries(plain) < binaries(bundle)
    specs = _decode_step_launches(decoder, kv, b, (1, 2, 4))
    assert binaries(specs) <= binaries(bundle)
    assert binaries(specs) - binaries(plain)  # the batch-1 step ran folded variants


def test_int4_small_and_mid_batch_halves_are_bundled_and_run_their_batches(tmp_path):
    """An INT4 engine whose w4a16_gemm tactics carry a small-batch half (an mma tactic) runs
    the tensor-core GEMV at decode batches 2 and 4 where the pair alone runs the GEMM, batch
    1 the decode GEMV; with a medium-batch half too, batch 16 runs the split-K GEMM and its
    sum kernel (or, a tensor-core one, the GEMV with 2 x tiles) where the others run the GEMM; each bundle holds every binary those steps
    launch, and the split-K pair compiles for sm_90."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle as kb
    from ingot.compiler.quantize.layout import checkpoint_layout
    from ingot.plugins.quant import triton_w4a16 as tw
    from ingot.plugins.quant import unused_plugins

    m, q = LLAMA_3_1_8B, QuantConfig(mode="int4_awq")
    b = BuildConfig(max_batch_size=16, max_seq_len=512, max_num_tokens=256,
                    tokens_per_block=64, target="sm_90")  # fmt: skip
    st = {"I32": torch.int32, "BF16": torch.bfloat16, "F32": torch.float32}
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: (s, st[d]) for n, (s, d) in checkpoint_layout(m, q).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    unused = unused_plugins(q.mode)
    defaults = tuple(c for c in default_choices("sm_90", m) if c.name not in unused)

    def with_w4a16(t):
        return tuple(replace(c, tactic=t.name, params=t.as_dict()) if c.name.startswith("w4a16")
                     else c for c in defaults)  # fmt: skip

    dec, mm, sb = tw.DECODE_TACTICS[0], tw.GEMM_TACTICS[0], tw.SMALL_TACTICS[0]
    x2 = next(t for t in tw.MID_TACTICS if t.as_dict().get("xtiles") == 2)
    # a cross-build's default: both halves (the "mid" variant)
    assert defaults == with_w4a16(tw.combine_tactics(dec, mm, sb, tw.MID_TACTICS[0]))
    variants = {"pair": with_w4a16(tw.combine_tactics(dec, mm)),
                "small": with_w4a16(tw.combine_tactics(dec, mm, sb)),
                "mid": with_w4a16(tw.combine_tactics(dec, mm, sb, tw.MID_TACTICS[0])),
                "mid_mma": with_w4a16(tw.combine_tactics(dec, mm, sb, x2))}  # fmt: skip
    launched = {}
    for name, choices in variants.items():
        bundle = binaries(kb.engine_launches(m, q, b, choices, shapes))
        decoder, kv = kb.dry_run_decoder(m, q, b, choices, shapes)
        for n in (1, 2, 4, 16):
            specs = _decode_step_launches(decoder, kv, b, (n,))
            assert binaries(specs) <= bundle, (name, n)
            launched[name, n] = [s.fn.rsplit(":", 1)[-1] for s in specs]
            if (name, n) == ("mid", 16):
                split = [s for s in specs if s.fn.endswith(("_w4a16_mm_kernel", "_sum_kernel"))]
    mma, gemm, sums = "_w4a16_mma_gemv_kernel", "_w4a16_mm_kernel", "_split_k_sum_kernel"
    for fn in (gemm, sums):
        assert compile_for_sm90(next(s for s in split if s.fn.endswith(fn)), tmp_path).asm["cubin"]
    layers = m.num_layers
    for n in (2, 4):
        assert launched["pair", n].count(gemm) == 4 * layers and mma not in launched["pair", n]
        for name in ("small", "mid"):
            assert launched[name, n].count(mma) == 4 * layers and gemm not in launched[name, n]
    for name in ("pair", "small"):
        assert launched[name, 16].count(gemm) == 4 * layers and sums not in launched[name, 16]
    assert launched["mid", 16].count(gemm) == launched["mid", 16].count(sums) == 4 * layers
    # the tensor-core medium half: one launch of 16 rows a site, no GEMM
    assert launched["mid_mma", 16].count(mma) == 4 * layers and gemm not in launched["mid_mma", 16]
    assert launched["small", 1] == launched["mid", 1] == launched["pair", 1]
    assert mma not in launched["small", 1]


@pytest.mark.parametrize("mode", ["fp8", "int4_awq"])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_quantized_engines_run_the_qkv_rope_gemv_at_decode_sizes(mode, fused_norms):
    """A quantized engine with its QKV-RoPE plugin (fp8_qkv_rope_gemm: W8A8 with an FP8 KV
    cache; w4a16_qkv_rope_gemm: INT4 AWQ): its batch-1 decode steps project QKV with the GEMV
    that rotates and writes the KV cache in its epilogue (FP8: SCALED; normalizing, and for
    FP8 quantizing, x as it loads it when the norms fold; else FP8 reads the norm-quantize
    kernel's FP8 x) and launch no RoPE kernel; larger batches keep the GEMM and the RoPE +
    KV-write kernel. Every launch is a bundled binary."""
    from dataclasses import replace

    from ingot.compiler import kernel_bundle as kb
    from ingot.compiler.quantize.layout import checkpoint_layout
    from ingot.plugins.quant import unused_plugins
    from ingot.plugins.quant import w4a16_qkv_rope as wq
    from ingot.plugins.quant.cuda_fp8 import FP8_GEMM_TACTICS

    fp8 = mode == "fp8"
    m = LLAMA_3_1_8B
    q = QuantConfig(mode=mode, kv_cache_dtype="fp8" if fp8 else "auto")
    b = BuildConfig(max_batch_size=4, max_seq_len=512, max_num_tokens=256, tokens_per_block=32,
                    target="sm_90", fused_norms=fused_norms)  # fmt: skip
    st = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32,
          "I32": torch.int32}  # fmt: skip
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: (s, st[d]) for n, (s, d) in checkpoint_layout(m, q).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    unused = unused_plugins(q.mode)
    choices = tuple(c for c in default_choices("sm_90", m) if c.name not in unused)
    plugin = "fp8_qkv_rope_gemm" if fp8 else "w4a16_qkv_rope_gemm"
    assert plugin in {c.name for c in choices}
    if fused_norms and fp8:  # the norms fold into GEMVs: the SwiGLU down's default is unfused
        gemv = next(t for t in FP8_GEMM_TACTICS if t.as_dict().get("max_m"))
        choices = tuple(
            replace(c, tactic=gemv.name, params=gemv.as_dict())
            if c.name in ("fp8_gemm", "fp8_swiglu_gemm") else c
            for c in choices
        )  # fmt: skip
    bundle = binaries(kb.engine_launches(m, q, b, choices, shapes))
    decoder, kv = kb.dry_run_decoder(m, q, b, choices, shapes)
    assert decoder.quant_qkv_rope is not None
    assert decoder.fold_rows == (1 if fused_norms else 0)
    fn = qkv_rope._qkv_rope_kernel if fp8 else wq._w4a16_qkv_rope_kernel
    for batch in (1, 4):
        specs = _decode_step_launches(decoder, kv, b, (batch,))
        assert binaries(specs) <= bundle
        fused = [s for s in specs if s.fn.endswith(":" + fn.__name__)]
        rope = [s for s in specs if s.fn.endswith(":_rope_kernel")]
        if batch > 1:
            assert not fused and len(rope) == m.num_layers
            continue
        assert len(fused) == m.num_layers and not rope, (len(fused), len(rope))
        assert {_constexpr(s, fn, "KV_FP8") for s in fused} == {fp8}
        # folded: every layer but the first normalizes x as it loads it
        norm = [_constexpr(s, fn, "NORM") for s in fused]
        assert norm == [False] + [fused_norms] * (m.num_layers - 1), norm
        if fp8:
            assert {_constexpr(s, fn, "SCALED") for s in fused} == {True}
            assert [_constexpr(s, fn, "QUANT_X") for s in fused] == norm


@pytest.mark.parametrize("max_batch_size", [64, 4])
def test_prefill_graphs_of_several_sequences_launch_bundled_binaries(monkeypatch, max_batch_size):
    """The prefill graph runner itself (runtime/cuda_graphs.PrefillGraphs, each graph run once
    on the `meta` device instead of captured) launches only binaries the bundle holds, at
    every (sequences, tokens) key it captures."""
    from recorded_graphs import record_graphs

    import ingot.runtime.cuda_graphs as cg
    from ingot.compiler import kernel_bundle as kb

    monkeypatch.setattr(cg, "capture_graphs", record_graphs)
    m = LLAMA_3_1_8B
    b = BuildConfig(max_batch_size=max_batch_size, max_seq_len=4096, max_num_tokens=1024,
                    tokens_per_block=64, target="sm_90", pdl=True)  # fmt: skip
    choices = tuple(default_choices("sm_90", m))
    shapes = {n: (s, torch.bfloat16) for n, s in expected_tensor_shapes(m).items()}
    shapes |= {n: ((b.max_seq_len, m.head_dim), torch.float32) for n in ("rope.cos", "rope.sin")}
    bundle = engine_launches(m, QuantConfig(), b, choices, shapes)
    decoder, kv = kb.dry_run_decoder(m, QuantConfig(), b, choices, shapes)
    width = -(-b.max_seq_len // b.tokens_per_block)
    buckets = cg.prefill_buckets(b.max_num_tokens)
    keys = cg.prefill_graph_keys(buckets, max_batch_size)
    with kb.recorded_launches() as specs:
        pg = cg.PrefillGraphs(decoder, kv, keys, width, torch.device("meta"))
    assert set(pg.graphs) == set(keys) and len(keys) > len(buckets)
    assert pg.tiers == ([1, 8, 64] if max_batch_size == 64 else [1, 4])
    assert any(s.fn.endswith(":_decode_kernel") for s in specs)  # the sampling rows' attention
    assert binaries(specs) <= binaries(bundle)
