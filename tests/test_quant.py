"""Quantization: the CPU references (FP8 GEMM, W4A16 GEMM, FP8 KV cache), the export from
ModelOpt's calibrated model, and the accuracy report of quantized checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from ingot.compiler.checkpoint import load_checkpoint
from ingot.compiler.convert import convert_checkpoint
from ingot.compiler.quantize import QuantOptions
from ingot.compiler.quantize.int4_awq import int4_linear_tensors
from ingot.compiler.quantize.layout import repack_for_engine
from ingot.plugins.attention.reference import paged_attention, write_kv
from ingot.plugins.quant.reference import (
    dequantize_w4,
    fp8_linear,
    pack_int4,
    pack_w4_engine,
    quantize_fp8,
    unpack_int4,
    unpack_w4_engine,
    w4a16_linear,
)
from ingot.runtime.config import QuantConfig

pytest.importorskip("modelopt.torch.quantization")

# K must be a multiple of the AWQ group size (128): hidden 128, intermediate 256.
SIZES = {"hidden_size": 128, "intermediate_size": 256}
G = 128


def _scale(t: torch.Tensor) -> torch.Tensor:
    return (t.float().abs().max() / 448).reshape(())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_gemm_matches_scaled_mm_and_dequantized_matmul(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 256, generator=g).to(dtype)
    w = torch.randn(96, 256, generator=g)
    b = torch.randn(96, generator=g).to(dtype)
    ws, xs = _scale(w), _scale(x)
    wq = quantize_fp8(w, ws)
    y = fp8_linear(x, wq, ws, xs, b)
    assert y.dtype == dtype and y.shape == (7, 96)
    # The plain matmul of the dequantized operands (what the reference promises to compute).
    deq = (quantize_fp8(x, xs).float() * xs) @ (wq.float() * ws).t() + b.float()
    # one rounding of the output dtype apart at most: the fp32 sums' order follows the CPU
    # matmul's blocking, which follows its thread count (one flipped an fp16 rounding)
    rtol = max(1e-5, torch.finfo(dtype).eps)
    torch.testing.assert_close(y, deq.to(dtype), rtol=rtol, atol=1e-5)
    # torch._scaled_mm, which the GPU kernel will call, gives the same numbers on the CPU.
    if dtype != torch.float32:
        ref = torch._scaled_mm(
            quantize_fp8(x, xs), wq.t(), scale_a=xs, scale_b=ws, bias=b, out_dtype=dtype
        )
        torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)
    # And close to the unquantized product (FP8 e4m3: ~2^-4 relative per operand).
    exact = x.float() @ w.t() + b.float()
    assert (y.float() - exact).norm() / exact.norm() < 0.06


@pytest.mark.parametrize("fast", [0, 1])
@pytest.mark.parametrize("where", [None, "129-448,1025-2048,8192-"])
@pytest.mark.parametrize("rows", [64, 128, 129, 448, 449, 511, 512, 1024, 1025, 2049, 8192])
def test_fp8_gemm_hands_fast_accumulation_to_cublaslt(monkeypatch, fast, where, rows):
    """A tactic's fast_accum (build-engine --fp8-fast-accum) reaches `torch._scaled_mm` on the
    cuBLASLt path for the rows of its fast_accum_rows (a build on the GPU times them), else from
    FAST_ACCUM_MIN_ROWS on (meta tensors: the call is recorded)."""
    pytest.importorskip("triton")
    from ingot.plugins.quant import cuda_fp8

    calls = []

    def scaled_mm(a, b, **kw):
        calls.append(kw)
        return torch.empty(a.shape[0], b.shape[1], dtype=kw["out_dtype"], device=a.device)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    t = cuda_fp8.FP8_GEMM_TACTICS[0]
    fn = cuda_fp8.make_fp8_linear(cuda_fp8.fast_accum_tactic(t, where) if fast else t)
    xq = torch.empty(rows, 256, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(96, 256, dtype=torch.float8_e4m3fn, device="meta")
    one = torch.ones((), device="meta")
    y = fn(xq, w, one, one, out_dtype=torch.bfloat16)
    if where is None:
        on = rows >= 512 and cuda_fp8.FAST_ACCUM_MIN_ROWS == 512
    else:
        on = 129 <= rows <= 448 or 1025 <= rows <= 2048 or rows >= 8192
    assert y.shape == (rows, 96) and [c["use_fast_accum"] for c in calls] == [bool(fast) and on]


def test_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([[1000.0, -1000.0, 1.0]])
    q = quantize_fp8(x, torch.tensor(1.0))
    assert q.float().tolist() == [[448.0, -448.0, 1.0]]


def test_int4_pack_roundtrip_and_layout():
    codes = torch.randint(0, 16, (6, 32), generator=torch.Generator().manual_seed(1))
    words = pack_int4(codes)
    assert words.dtype == torch.int32 and words.shape == (6, 4)
    assert torch.equal(unpack_int4(words), codes.to(torch.int32))
    # Low nibble first: word 0 of row 0 holds codes[0, 0] in bits 0..3.
    assert int(words[0, 0]) & 0xF == int(codes[0, 0])


def test_int4_engine_layout_interleaves_each_128_k():
    codes = torch.randint(0, 16, (3, 256), generator=torch.Generator().manual_seed(5))
    words = pack_w4_engine(codes)
    assert words.shape == (3, 32) and torch.equal(unpack_w4_engine(words), codes.to(torch.int32))
    for n, b, c, j in ((0, 0, 0, 0), (1, 0, 1, 2), (2, 1, 15, 7), (0, 1, 3, 5)):
        # word c of block b holds k = 128 b + 16 j + c in nibble j
        assert (int(words[n, 16 * b + c]) >> (4 * j)) & 0xF == int(codes[n, 128 * b + 16 * j + c])
    q = QuantConfig("int4_awq")
    ckpt = pack_int4(codes)  # the checkpoint keeps k order
    assert torch.equal(repack_for_engine(q, "layers.0.mlp.down.weight", ckpt), words)
    scales = torch.rand(3, 2)
    assert torch.equal(repack_for_engine(q, "layers.0.mlp.down.weight_scale", scales), scales)
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_w4_engine(codes[:, :64])


@pytest.mark.parametrize("asymmetric", [False, True])
def test_w4a16_equals_matmul_on_dequantized_weight(asymmetric):
    g = torch.Generator().manual_seed(2)
    n, k = 64, 256
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // G, generator=g) * 0.1 + 0.01  # [N, K/G]
    zeros = torch.randint(0, 16, (n, k // G), generator=g) if asymmetric else None
    pqs = torch.rand(k, generator=g) + 0.5
    x = torch.randn(5, k, generator=g)
    qw = pack_w4_engine(codes)  # engine layout [N, K/8], interleaved per 128 k
    y = w4a16_linear(x, qw, scales, pqs, G, zeros)
    zf = 8 if zeros is None else zeros.repeat_interleave(G, dim=1)
    w = (codes - zf).float() * scales.repeat_interleave(G, dim=1)  # [N, K]
    torch.testing.assert_close(y, (x * pqs) @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dequantize_w4(qw, scales, G, zeros), w)
    # gated (the down projection): [gate | up] in, SwiGLU's output multiplied
    gate_up = torch.randn(5, 2 * k, generator=g)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    assert torch.equal(w4a16_linear(gate_up, qw, scales, pqs, G, zeros, gated=True),
                       w4a16_linear(act, qw, scales, pqs, G, zeros))  # fmt: skip


def test_w4a16_plugin_on_cpu_is_the_reference():
    """Without Triton's interpreter the GPU plugin hands CPU tensors to the reference."""
    from ingot.plugins.quant import triton_w4a16

    g = torch.Generator().manual_seed(3)
    qw = pack_w4_engine(torch.randint(0, 16, (40, 128), generator=g))
    scales, b = torch.rand(40, 1, generator=g) * 0.02, torch.randn(40, generator=g)
    for x, gated in ((torch.randn(2, 128, generator=g), False),
                     (torch.randn(1, 256, generator=g), True)):  # fmt: skip
        out = triton_w4a16.make_w4a16_linear(None)(x, qw, scales, None, G, None, b, gated=gated)
        assert torch.equal(out, w4a16_linear(x, qw, scales, None, G, None, b, gated=gated))


def test_int4_quantization_error_is_within_half_a_step_and_fusion_keeps_outputs():
    g = torch.Generator().manual_seed(3)
    k = 256
    parts = [torch.randn(32, k, generator=g), torch.randn(16, k, generator=g)]
    pqs = [torch.rand(k, generator=g) + 0.5, torch.rand(k, generator=g) + 0.5]
    amax = [p.abs().reshape(p.shape[0], -1, G).amax(-1) for p in parts]
    t = int4_linear_tensors(parts, pqs, amax, G, torch.float32)
    assert t["weight"].shape == (48, k // 8) and t["weight_scale"].shape == (48, k // G)
    q = QuantConfig("int4_awq")
    w = dequantize_w4(
        repack_for_engine(q, "layers.0.attn.qkv.weight", t["weight"]),
        repack_for_engine(q, "layers.0.attn.qkv.weight_scale", t["weight_scale"]),
        G,
    )
    # One shared activation scale: the fused weight re-expresses every part exactly.
    s_f = t["pre_quant_scale"]
    want = torch.cat([p * (s / s_f) for p, s in zip(parts, pqs, strict=True)])
    step = t["weight_scale"].repeat_interleave(G, dim=1)
    assert ((w - want).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(4, k, generator=g)
    fused = (x * s_f) @ w.t()
    per_part = torch.cat([(x * s) @ p.t() for p, s in zip(parts, pqs, strict=True)], dim=1)
    assert (fused - per_part).norm() / per_part.norm() < 0.15


def test_fp8_kv_cache_roundtrip_and_plain_cache_unchanged():
    g = torch.Generator().manual_seed(4)
    hkv, hq, hd, bs, n = 2, 4, 16, 4, 10
    k, v = torch.randn(n, hkv, hd, generator=g), torch.randn(n, hkv, hd, generator=g)
    q = torch.randn(n, hq, hd, generator=g)
    meta = (torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([n]), torch.tensor([0, n]))
    plain_k, plain_v = torch.zeros(3, bs, hkv, hd), torch.zeros(3, bs, hkv, hd)
    write_kv(k, v, plain_k, plain_v, torch.arange(n))
    ref = paged_attention(q, plain_k, plain_v, *meta, hd**-0.5)
    ks, vs = _scale(k), _scale(v)
    fk = torch.zeros(3, bs, hkv, hd, dtype=torch.float8_e4m3fn)
    fv = torch.zeros_like(fk)
    write_kv(k, v, fk, fv, torch.arange(n), k_scale=ks, v_scale=vs)
    assert torch.equal(fk.view(-1, hkv, hd)[:n], quantize_fp8(k, ks))
    out = paged_attention(q, fk, fv, *meta, hd**-0.5, k_scale=ks, v_scale=vs)
    assert (out - ref).norm() / ref.norm() < 0.06
    again = paged_attention(q, plain_k, plain_v, *meta, hd**-0.5)
    assert torch.equal(again, ref)  # no scales: the plain path, bit for bit


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Tiny llama converted three ways: fp32, fp8 (+ FP8 KV cache), int4_awq."""
    from ingot.compiler.examples import make_tiny_hf_model

    root = tmp_path_factory.mktemp("quant")
    hf = make_tiny_hf_model("llama", root / "hf", seed=1, **SIZES)
    opts = dict(calib_size=8, calib_max_seq_len=128, device="cpu")
    return {
        "hf": hf,
        "none": convert_checkpoint(hf, root / "none"),
        "fp8": convert_checkpoint(
            hf, root / "fp8", quant=QuantOptions("fp8", kv_cache_dtype="fp8", **opts)
        ),
        "int4_awq": convert_checkpoint(hf, root / "int4", quant=QuantOptions("int4_awq", **opts)),
    }


def test_quantized_checkpoints_store_the_documented_layout(quantized):
    meta, t = load_checkpoint(quantized["fp8"])
    assert meta["quant"] == QuantConfig("fp8", "fp8")
    assert t["layers.0.attn.qkv.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.1.mlp.down.input_scale"].shape == () and "layers.1.attn.k_scale" in t
    meta, t = load_checkpoint(quantized["int4_awq"])
    assert meta["quant"].mode == "int4_awq" and meta["quant"].group_size == G
    assert t["layers.0.mlp.down.weight"].shape == (128, 256 // 8)
    assert t["layers.0.mlp.down.weight_scale"].shape == (128, 256 // G)
    assert t["layers.0.mlp.gate_up.pre_quant_scale"].shape == (128,)
    assert "layers.0.mlp.down.weight_zero" not in t  # symmetric


def test_reports_are_within_bounds(quantized):
    reps = {
        m: json.loads((quantized[m] / "config.json").read_text()) for m in quantized if m != "hf"
    }
    assert "quant_report" not in reps["none"]
    fp8, int4 = reps["fp8"]["quant_report"], reps["int4_awq"]["quant_report"]
    for rep in (fp8, int4):
        assert rep["held_out"]["positions"] >= 256 and rep["calibration"]["samples"] >= 4
        # fp32 checkpoint, unquantized: ingot's CPU path is transformers' model exactly.
        assert rep["unquantized_baseline"]["top1_agreement"] == 1.0
        assert rep["unquantized_baseline"]["mean_kl"] < 1e-6
        assert 0 < rep["mean_kl"] <= rep["max_kl"]
        # where the convert's time went, phase by phase
        phases = ["load_model", "score_unquantized", "calibrate", "export", "accuracy_report"]
        assert list(rep["seconds"]) == phases and all(v >= 0 for v in rep["seconds"].values())
    # NOTE: a random tiny model has near-tied logits (median top-1 margin ~0.2 nats), so
    # top-1 flips easily; KL is the meaningful figure. FP8 loses far less than INT4.
    assert fp8["mean_kl"] < 0.05 and fp8["top1_agreement"] >= 0.6
    assert int4["mean_kl"] < 0.4 and int4["top1_agreement"] >= 0.25
    assert fp8["mean_kl"] < int4["mean_kl"]


@pytest.mark.parametrize("mode", ["fp8", "int4_awq"])
def test_report_prefills_its_windows_together_as_each_alone(quantized, mode):
    """The report's one packed prefill of every window (each quantized weight dequantized
    once) gives each window's logits as a prefill of that window alone."""
    from ingot.compiler.quantize.report import ingot_logits

    meta, t = load_checkpoint(quantized[mode])
    tensors = {n: t[n] for n in t}
    g = torch.Generator().manual_seed(3)
    vocab = meta["model"].vocab_size
    windows = [torch.randint(0, vocab, (1, n), generator=g) for n in (40, 64, 17)]
    together = ingot_logits(meta["model"], meta["quant"], tensors, windows)
    for w, got in zip(windows, together, strict=True):
        (alone,) = ingot_logits(meta["model"], meta["quant"], tensors, [w])
        assert got.shape == alone.shape == (w.shape[1], vocab)
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["fp8", "int4_awq"])
def test_export_matches_modelopt_fake_quant_on_unfused_linears(quantized, mode):
    """ingot's tensors through the CPU references reproduce ModelOpt's fake-quant QuantLinear
    (scale conventions, AWQ's pre_quant_scale, packing, the engine repack)."""
    from ingot.compiler.convert import build_plan, read_hf_config
    from ingot.compiler.hf_config import model_config_from_hf
    from ingot.compiler.quantize import calibrate, export

    hf = quantized["hf"]
    cfg = model_config_from_hf(read_hf_config(hf), "auto")
    opts = QuantOptions(mode, calib_size=2, calib_max_seq_len=64, device="cpu")
    model, tok = calibrate.load_hf_model(hf, "cpu", cfg)
    samples = calibrate.token_windows(tok, calibrate.calibration_text(None), 2, 64)
    calibrate.calibrate(model, opts, samples, lambda *a: None)
    out = export.export_tensors(
        model, cfg, opts.quant_config(), {}, build_plan(cfg), lambda *a: None
    )
    x = torch.randn(5, 256)
    p = "layers.1.mlp.down."
    with torch.no_grad():
        ref = model.get_submodule("model.layers.1.mlp.down_proj")(x)
    if mode == "fp8":
        y = fp8_linear(x, out[p + "weight"], out[p + "weight_scale"], out[p + "input_scale"])
    else:
        q = opts.quant_config()
        qw = repack_for_engine(q, p + "weight", out[p + "weight"])
        sc = repack_for_engine(q, p + "weight_scale", out[p + "weight_scale"])
        y = w4a16_linear(x, qw, sc, out[p + "pre_quant_scale"], G)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_fp8_lm_head_apart_from_a_tied_embedding(tmp_path):
    """--quant-lm-head on a model whose lm_head is its embedding: the checkpoint gets an FP8
    lm_head of the same values (the embedding stays fp32), the engine's logits are the FP8 GEMM
    of the final hidden states, and the report prices it."""
    from ingot.compiler.build import build_engine
    from ingot.compiler.examples import make_tiny_hf_model
    from ingot.runtime.engine import load_engine
    from ingot.runtime.executor import Executor

    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=1, tie_word_embeddings=True, **SIZES)
    opts = QuantOptions("fp8", calib_size=4, calib_max_seq_len=64, device="cpu", lm_head=True)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", quant=opts)
    meta, t = load_checkpoint(ckpt)
    assert meta["quant"] == QuantConfig("fp8", lm_head=True)
    w, ws, xs = t["lm_head.weight"], t["lm_head.weight_scale"], t["lm_head.input_scale"]
    emb = t["embed.weight"]
    assert w.dtype == torch.float8_e4m3fn and emb.dtype == torch.float32
    deq = w.float() * ws
    assert ((deq - emb).norm() / emb.norm()) < 0.05  # e4m3 keeps 3 mantissa bits
    ex = Executor(load_engine(build_engine(ckpt, tmp_path / "engine", target="cpu")))
    hidden = torch.randn(3, SIZES["hidden_size"])
    logits = ex.decoder.logits(hidden)
    torch.testing.assert_close(logits, fp8_linear(hidden, w, ws, xs).float())
    assert not torch.allclose(logits, hidden @ emb.t(), rtol=1e-3, atol=1e-3)
    rep = json.loads((ckpt / "config.json").read_text())["quant_report"]
    assert 0 < rep["mean_kl"] < 0.1 and rep["top1_agreement"] >= 0.5


def test_int4_awq_fp8_lm_head_matches_modelopt_fake_quant(quantized):
    """INT4 AWQ with --quant-lm-head: ModelOpt smooths the lm_head too (x * pre_quant_scale
    before its FP8 input quantizer); ingot folds that scale into the final norm's weight, and
    the norm then the FP8 lm_head reproduce ModelOpt's fake-quant norm + lm_head."""
    from ingot.compiler.convert import build_plan, read_hf_config
    from ingot.compiler.hf_config import model_config_from_hf
    from ingot.compiler.quantize import calibrate, export
    from ingot.plugins.norm.reference import rms_norm

    cfg = model_config_from_hf(read_hf_config(quantized["hf"]), "auto")
    opts = QuantOptions("int4_awq", calib_size=2, calib_max_seq_len=64, device="cpu", lm_head=True)
    model, tok = calibrate.load_hf_model(quantized["hf"], "cpu", cfg)
    samples = calibrate.token_windows(tok, calibrate.calibration_text(None), 2, 64)
    calibrate.calibrate(model, opts, samples, lambda *a: None)
    norm = model.get_submodule("model.norm").weight.detach().clone()
    pqs = model.lm_head.input_quantizer.pre_quant_scale
    assert pqs is not None and not torch.allclose(pqs, torch.ones_like(pqs))
    out = export.export_tensors(
        model,
        cfg,
        opts.quant_config(),
        {"final_norm.weight": norm},
        build_plan(cfg),
        lambda *a: None,
    )
    h = torch.randn(5, SIZES["hidden_size"]) * 3
    with torch.no_grad():
        ref = model.lm_head(model.get_submodule("model.norm")(h))
    w, ws, xs = out["lm_head.weight"], out["lm_head.weight_scale"], out["lm_head.input_scale"]
    assert w.dtype == torch.float8_e4m3fn
    eps = cfg.rms_norm_eps
    ours = fp8_linear(rms_norm(h, out["final_norm.weight"], eps), w, ws, xs)
    unfolded = fp8_linear(rms_norm(h, norm, eps), w, ws, xs)

    def err(y):
        return float((y - ref).norm() / ref.norm())

    assert err(ours) < 1e-4 and err(unfolded) > 1e-2  # 1e-7 and 5e-2 when written


def test_fp8_engine_fuses_quantization_into_norm_and_swiglu(quantized, tmp_path):
    """The FP8 engine's fused norm/SwiGLU/attention-output quantization is the unfused path bit
    for bit: each fused op quantizes with the input scale of the GEMM it feeds."""
    from ingot.compiler.build import build_engine
    from ingot.runtime.engine import load_engine
    from ingot.runtime.executor import Executor
    from ingot.runtime.types import SamplingParams

    engine = build_engine(quantized["fp8"], tmp_path / "engine", target="cpu")
    ex = Executor(load_engine(engine), enable_prefix_reuse=False)
    assert ex.decoder.fp8_fused
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=1, return_prompt_logits=True)

    def prompt_logits() -> torch.Tensor:
        req = ex.add_request(prompt, params)
        ex.run_until_done()
        return torch.cat(req.prompt_logits)

    fused = prompt_logits()
    assert ex.decoder.fp8_attn_out
    ex.decoder.fp8_attn_out = False  # the o projection quantizes the attention output itself
    assert torch.equal(prompt_logits(), fused)
    ex.decoder.fp8_fused = False  # quantize inside each FP8 GEMM instead
    assert torch.equal(prompt_logits(), fused)
    # a wrong scale would show: feed the qkv GEMMs the gate/up input scales
    ex.decoder.fp8_fused = True
    w = ex.decoder.w
    for i in range(ex.config.model.num_layers):
        w[f"layers.{i}.attn.qkv.input_scale"] = w[f"layers.{i}.mlp.gate_up.input_scale"] * 3
    assert not torch.equal(prompt_logits(), fused)


def test_fp8_kv_decode_v_stored_by_attention(quantized, tmp_path):
    """An FP8 KV engine storing the decode rows' V in paged_attention (new_v, the Decoder's
    decode_writes_v option) instead of the RoPE kernel: the same tokens and the same KV pool
    bits, through decode-only steps and mixed steps (a prompt's chunks beside the decodes)."""
    from ingot.compiler.build import build_engine
    from ingot.runtime.engine import load_engine
    from ingot.runtime.executor import Executor
    from ingot.runtime.types import SamplingParams

    build = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 32, "tokens_per_block": 16}
    engine = build_engine(quantized["fp8"], tmp_path / "engine", target="cpu", overrides=build)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 23, 17, 70)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    def run(by_attention: bool) -> tuple[list[list[int]], torch.Tensor, int]:
        ex = Executor(load_engine(engine), enable_prefix_reuse=False)
        assert not ex.decoder.decode_writes_v  # off by default (runtime/model.py)
        ex.decoder.decode_writes_v = by_attention
        calls = []
        attention = ex.decoder.ops._fns[("paged_attention", None)]

        def counted(*a, **kw):  # (decode rows handed over, sequences) per call
            calls.append((0 if kw.get("new_v") is None else kw["new_v"].shape[0], a[4].numel()))
            return attention(*a, **kw)

        ex.decoder.ops._fns[("paged_attention", None)] = counted
        reqs = [ex.add_request(p, params) for p in prompts[:-1]]
        for _ in range(3):
            ex.step()
        reqs.append(ex.add_request(prompts[-1], params))  # its chunks join the decodes
        ex.run_until_done()
        pool = torch.cat([t.reshape(-1) for i in range(ex.config.model.num_layers)
                          for t in ex.kv.layer(i)]).view(torch.uint8)  # fmt: skip
        return [r.output_ids for r in reqs], pool, calls

    tokens, pool, calls = run(True)
    assert calls[0][0] == 0 and (4, 4) in calls  # a prefill, decode-only steps
    assert any(0 < n < b for n, b in calls)  # and mixed steps
    tokens_rope, pool_rope, calls_rope = run(False)
    assert {n for n, _ in calls_rope} == {0}
    assert tokens == tokens_rope and torch.equal(pool, pool_rope)


@pytest.mark.parametrize("trained", [False, True])
def test_gpu_e2e_model_is_robust_to_summation_order(tmp_path, monkeypatch, trained):
    """Why tests/test_gpu_quant_e2e.py trains its model: 1e-3 relative noise in the FP8 GEMM
    outputs (more than a GPU's other summation order) flips a random model's near-tied greedy
    tokens, the trained one's not."""
    from reference_runs import (
        random_prompts,
        serve_staggered,
        strict_agreement,
        train_next_token_map,
    )

    import ingot.plugins.quant.reference as qref
    from ingot.compiler.build import build_engine
    from ingot.compiler.examples import make_tiny_hf_model

    hf = make_tiny_hf_model("llama", tmp_path / "hf", seed=4, **SIZES)
    if trained:
        train_next_token_map(hf)
    opts = QuantOptions("fp8", "fp8", calib_size=4, calib_max_seq_len=64, device="cpu")
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="bfloat16", quant=opts)
    build = {"max_batch_size": 8, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}
    engine = build_engine(ckpt, tmp_path / "engine", target="cpu", overrides=build)
    prompts = random_prompts(512, seed=9)
    exact = serve_staggered(engine, prompts, 16)
    matmul = qref.fp8_matmul

    def noisy(xq, weight, weight_scale, input_scale, bias, out_dtype):
        y = matmul(xq, weight, weight_scale, input_scale, bias, torch.float32)
        return (y * (1 + 1e-3 * torch.randn_like(y))).to(out_dtype)

    monkeypatch.setattr(qref, "fp8_matmul", noisy)
    torch.manual_seed(0)
    agreement = strict_agreement(serve_staggered(engine, prompts, 16), exact)
    if trained:
        assert agreement >= 0.95
    else:
        assert agreement < 0.9  # the random model is not a fair judge of kernels
