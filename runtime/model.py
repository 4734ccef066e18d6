"""The one decoder graph (Llama / Mistral / Qwen2 / Qwen3), run op by op through plugins.

Inputs are a packed batch: T tokens from B sequences, prefill chunks and decodes mixed, with the
paged-KV metadata the C++ scheduler produced. Weights use the canonical names of docs/formats.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ingot.plugins import Tactic, get_spec, load, pdl, target_kind
from ingot.plugins.attention.reference import decode_rows
from ingot.plugins.gemm.fused_norm import AddOut, NormIn, new_sums

from .config import ModelConfig, QuantConfig
from .distributed import vocab_range
from .engine import EngineConfig
from .kv_cache import KVCache
from .linear import make_linear

# the largest forward pass (tokens) that uses programmatic dependent launch (Decoder.uses_pdl)
PDL_MAX_ROWS = 8


@dataclass
class AttnMetadata:
    """Per step. slot_mapping/positions: [T]; block_tables: [B, max_blocks];
    context_lens: [B]; query_start_loc: [B+1]; all int32 on the model's device."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_context_len: int  # an upper bound is fine (sizes GPU grids)
    max_query_len: int  # 1 means every sequence decodes one token
    # the last num_decodes sequences have one query each (a mixed step's decodes; host-known),
    # or ANY_DECODES: the one-query sequences may sit anywhere (a captured graph)
    num_decodes: int = 0


@dataclass
class SampleRows:
    """The rows of a step whose hidden states are sampled (each the last query of its sequence,
    which sits at its context's last position) and their sequences' indices, [R] int32 each on
    the model's device. Only the KV cache needs the other rows of the last layer, so after its
    QKV projection and KV write the rest of that layer (attention, o projection, MLP, final
    norm) runs on these R rows: for a 2,048-token prompt, 2,047 rows of a layer's o, gate_up
    and down GEMMs fewer."""

    rows: torch.Tensor
    seqs: torch.Tensor

    def meta(self, meta: AttnMetadata, tokens_per_block: int) -> AttnMetadata:
        """The attention metadata of one query per sampling sequence, as a decode step of R
        sequences has it: the context bound is the block tables' (max_seq_len rounded up to a
        block), as the decode graphs' is, so the decode kernel runs the variants (split or not)
        the engine's kernel bundle already holds."""
        r = self.seqs.shape[0]
        return AttnMetadata(
            slot_mapping=meta.slot_mapping,  # the KV write is done; attention does not read it
            block_tables=meta.block_tables.index_select(0, self.seqs),
            context_lens=meta.context_lens.index_select(0, self.seqs),
            query_start_loc=torch.arange(r + 1, dtype=torch.int32, device=self.seqs.device),
            max_context_len=meta.block_tables.shape[1] * tokens_per_block,
            max_query_len=1,
            num_decodes=r,
        )


def trailing_decodes(query_lens) -> int:
    """How many sequences at the end of a step have exactly one query (AttnMetadata).
    query_lens: a sequence (list or 1-D array)."""
    n = len(query_lens)
    while n and query_lens[n - 1] == 1:
        n -= 1
    return len(query_lens) - n


class Ops:
    """The plugin callables an engine was built with, resolved for this device kind.

    `ops.NAME` is the op's engine-wide choice; `ops.at(NAME, site)` prefers a choice made for
    that use site (tactics timed at that site's shapes).
    """

    def __init__(self, cfg: EngineConfig) -> None:
        kind = target_kind(cfg.target)
        # the forward pass's Triton kernels use programmatic dependent launch (plugins/pdl.py)
        self.pdl = cfg.build.pdl and kind == "cuda"
        # the decode GEMVs fold the norms between them in (plugins/gemm/fused_norm.py)
        self.fused_norms = cfg.build.fused_norms and kind == "cuda"
        self._fns: dict[tuple[str, str | None], Callable[..., Any]] = {}
        for choice in cfg.plugins:
            tactic = None
            if choice.tactic is not None:
                tactic = Tactic(choice.tactic, tuple(sorted((choice.params or {}).items())))
            get_spec(choice.name, choice.version)
            self._fns[(choice.name, choice.site)] = load(choice.name, choice.version, kind, tactic)

    def at(self, name: str, site: str | None) -> Callable[..., Any]:
        return self._fns.get((name, site)) or getattr(self, name)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self.__dict__["_fns"][(name, None)]
        except KeyError:
            raise AttributeError(f"engine has no plugin {name!r}") from None


def _fused_gemv(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """A GEMM with the activation before it fused in, or None when its tactic has no GEMV
    (`gemv_rows` 0): the build picks such a tactic where the activation kernel and the plain
    GEMM's own tactic at that site measured faster at batch 1 (compiler/tactic_select.py
    `unfused_if_faster`), so the decoder runs those two."""
    return None if getattr(fn, "gemv_rows", None) == 0 else fn


class Decoder:
    """Forward pass over a packed batch. Holds views of the engine's weights (no copies).

    comm: None for tp 1. With tensor parallelism (runtime/distributed.py) `weights` are this
    rank's shards: its q and kv heads (local q heads r*Hq/tp.. pair with local kv heads
    r*Hkv/tp.., so GQA groups stay within a rank), its gate/up rows and o/down columns, its
    vocabulary rows; `cfg` stays the full model's.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        quant: QuantConfig | None = None,
        comm=None,
    ) -> None:
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        self.comm = comm
        tp = comm.world if comm is not None else 1
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        if comm is not None:
            self.vocab_start, self.vocab_local = vocab_range(cfg.vocab_size, tp, comm.rank)
        quant = quant or QuantConfig()
        dtype = weights["embed.weight"].dtype  # the model (activation) dtype
        self.linears = {
            f"layers.{i}.{name}": make_linear(ops, weights, f"layers.{i}.{name}", quant, dtype)
            for i in range(cfg.num_layers)
            for name in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
        }
        self.scale = cfg.head_dim**-0.5
        self.fp8_kv = quant.kv_cache_dtype == "fp8"  # quantization: K/V stored as fp8 / scale
        self.quant_mode = quant.mode
        # RoPE fused with the KV write when the engine has it (engines built before it do not)
        self.fused_rope_kv = hasattr(ops, "rope_kv_write")
        # The decode rows' V stored by the decode attention kernel (paged_attention new_v; in
        # whole 32-byte sectors in an FP8 pool, which keeps V transposed) instead of by the RoPE
        # kernel (a byte in each of hd sectors). Off: both kernel versions cost the attention
        # more than the RoPE kernel saved (docs/performance.md, 12-03 19:25 and 21:20).
        self.decode_writes_v = False
        # The QKV projection with RoPE and the KV write in its epilogue at decode sizes
        # (unquantized weights, model-dtype or FP8 cache, in engines that have the plugin;
        # Qwen3's q/k norms sit between the two).
        self.qkv_rope = None
        if quant.mode == "none" and not cfg.qk_norm and hasattr(ops, "qkv_rope_gemm"):
            self.qkv_rope = ops.at("qkv_rope_gemm", "attn.qkv")
        # SwiGLU fused into the down projection (unquantized engines that have the plugin)
        self.swiglu_down = None
        if quant.mode == "none" and hasattr(ops, "swiglu_gemm"):
            self.swiglu_down = _fused_gemv(ops.at("swiglu_gemm", "mlp.down"))
        # FP8: the norms and SwiGLU quantize their output for the FP8 GEMM after them (engines
        # built before these plugins quantize inside the GEMM plugin instead)
        self.fp8_fused = quant.mode == "fp8" and all(
            hasattr(ops, n) for n in ("rms_norm_quant_fp8", "swiglu_quant_fp8")
        )
        # ...and the attention kernels quantize their output for the FP8 o projection (one
        # quantize launch fewer per layer; the same bits)
        self.fp8_attn_out = self.fp8_fused
        # ...and the SwiGLU-quantize folded into the FP8 down projection (engines that have it)
        self.fp8_swiglu_down = None
        if self.fp8_fused and hasattr(ops, "fp8_swiglu_gemm"):
            self.fp8_swiglu_down = _fused_gemv(ops.at("fp8_swiglu_gemm", "mlp.down"))
        # Quantized engines: the FP8 / W4A16 QKV GEMV with RoPE and the KV write in its
        # epilogue, for the passes its GEMV takes (`_quant_qkv_rope_rows`; larger ones keep
        # the RoPE kernel, whose V store into an FP8 pool goes a segment at a time for prompts)
        self.quant_qkv_rope = None
        self.group_size = quant.group_size
        rope_plugin = {"fp8": "fp8_qkv_rope_gemm", "int4_awq": "w4a16_qkv_rope_gemm"}.get(
            quant.mode
        )
        fused_ok = self.fp8_fused or quant.mode == "int4_awq"
        if rope_plugin and fused_ok and not cfg.qk_norm and hasattr(ops, rope_plugin):
            self.quant_qkv_rope = ops.at(rope_plugin, "attn.qkv")
        self.dtype = dtype
        self.lm_head = weights.get("lm_head.weight", weights["embed.weight"])
        self.cos = weights["rope.cos"]  # [max_seq_len, hd] float32
        self.sin = weights["rope.sin"]
        if quant.lm_head:  # FP8 lm_head: the final norm's output is quantized inside the GEMM
            fp8 = ops.at("fp8_gemm", "lm_head")
            ws, xs = weights["lm_head.weight_scale"], weights["lm_head.input_scale"]
            self._lm_head = lambda x, w: fp8(x, w, ws, xs, None, out_dtype=dtype)
        else:
            self._lm_head = ops.at("gemm", "lm_head")
        self.fold_rows = self.norm_fold_rows(quant)

    def norm_fold_rows(self, quant: QuantConfig) -> int:
        """The largest pass (tokens) whose norms fold into the decode GEMVs around them
        (plugins/gemm/fused_norm.py): the fewest rows any of a layer's four GEMV sites runs on
        its GEMV kernel; 0: never (not asked for, tensor parallel: the partial sums meet in an
        all-reduce first, or a site without a GEMV that folds)."""
        ops = self.ops
        if not getattr(ops, "fused_norms", False) or self.comm is not None:
            return 0
        if quant.mode == "none":
            sites = [self.qkv_rope or ops.at("gemm", "attn.qkv"), ops.at("gemm", "attn.o"),
                     ops.at("gemm", "mlp.gate_up"),
                     self.swiglu_down or ops.at("gemm", "mlp.down")]  # fmt: skip
        elif quant.mode == "fp8" and self.fp8_attn_out and self.fp8_swiglu_down is not None:
            sites = [ops.at("fp8_gemm", s) for s in ("attn.qkv", "attn.o", "mlp.gate_up")]
            sites.append(self.fp8_swiglu_down)
        elif quant.mode == "int4_awq":  # the W4A16 GEMVs (down: SwiGLU inside)
            sites = [ops.at("w4a16_gemm", s) for s in ("attn.qkv", "attn.o", "mlp.gate_up",
                                                       "mlp.down")]  # fmt: skip
        else:
            return 0
        if self.quant_qkv_rope is not None:
            sites.append(self.quant_qkv_rope)
        return min(getattr(fn, "gemv_rows", 0) for fn in sites)

    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv: KVCache,
        rows: SampleRows | None = None,
        norm: NormIn | None = None,
        add: AddOut | None = None,
    ) -> torch.Tensor:
        """Layer i's attention block: QKV, RoPE and the KV write for every row, then attention
        and the o projection for every row, or for the sampling `rows` only. norm / add: the
        QKV GEMV normalizes x (the residual stream) as it loads it; the o GEMV adds into the
        residual stream and returns it (plugins/gemm/fused_norm.py)."""
        nk = {"norm": norm} if norm is not None else {}
        c, w, ops = self.cfg, self.w, self.ops
        p = f"layers.{i}.attn."
        k_cache, v_cache = kv.layer(i)
        # FP8 KV cache (quantization): the per-layer scales ride along; nothing extra otherwise.
        fp8 = {"k_scale": w[p + "k_scale"], "v_scale": w[p + "v_scale"]} if self.fp8_kv else {}
        # the o projection's FP8 input, quantized by the attention kernels (`fp8_attn_out`)
        out_q = {"out_scale": w[p + "o.input_scale"]} if self.fp8_attn_out else {}
        if self.qkv_rope is not None and not self.decode_writes_v:
            q = self.qkv_rope(
                x, w[p + "qkv.weight"], w.get(p + "qkv.bias"), positions, self.cos, self.sin,
                k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads, **fp8,
                **nk,
            )  # fmt: skip
            return self._attend(i, q, meta, k_cache, v_cache, dict(fp8, **out_q), rows, add)
        quant_rows = self._quant_qkv_rope_rows() if not self.decode_writes_v else 0
        if self.quant_qkv_rope is not None and x.shape[0] <= quant_rows:
            q = self.quant_qkv_rope(
                x, *self._qkv_weights(p + "qkv."), positions, self.cos, self.sin, k_cache,
                v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads, **fp8, **nk,
                **({"out_dtype": self.dtype} if self.quant_mode == "fp8" else {}),
            )  # fmt: skip
            return self._attend(i, q, meta, k_cache, v_cache, dict(fp8, **out_q), rows, add)
        qkv = self.linears[p + "qkv"](x, **nk)  # [T, qkv_size / tp]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, c.head_dim)
        k = k.reshape(-1, self.num_kv_heads, c.head_dim)
        v = v.reshape(-1, self.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = ops.rms_norm(q, w[p + "q_norm.weight"], c.rms_norm_eps)
            k = ops.rms_norm(k, w[p + "k_norm.weight"], c.rms_norm_eps)
        rope_kw, attn_kw = dict(fp8), dict(fp8, **out_q)
        if self.fused_rope_kv:
            t = q.shape[0]
            n = decode_rows(t, meta.context_lens.shape[0], meta.max_query_len, meta.num_decodes)
            rope_kw["runs"] = t - n  # prompt rows, slots in order: V a segment at a time
            if self.decode_writes_v:
                rope_kw["v_rows"], attn_kw["new_v"] = t - n, v[t - n :]
            q = ops.rope_kv_write(
                q, k, v, positions, self.cos, self.sin, k_cache, v_cache, meta.slot_mapping,
                **rope_kw,
            )  # fmt: skip
        else:
            q, k = ops.rope(q, k, positions, self.cos, self.sin)
            ops.kv_cache_write(k, v, k_cache, v_cache, meta.slot_mapping, **fp8)
        return self._attend(i, q, meta, k_cache, v_cache, attn_kw, rows, add)

    def _quant_qkv_rope_rows(self) -> int:
        """The largest pass the quantized QKV-RoPE plugin runs on its GEMV (0: none; the CPU
        references have none, so CPU engines keep the unfused ops)."""
        return getattr(self.quant_qkv_rope, "gemv_rows", 0)

    def _qkv_weights(self, p: str) -> tuple:
        """The quantized QKV plugin's weight arguments (the mode's GEMM plugin's, in its
        order): FP8 weight, weight and input scales, bias; W4A16 qweight, scales,
        pre_quant_scale, group size, zeros, bias."""
        w = self.w
        if self.quant_mode == "fp8":
            return (w[p + "weight"], w[p + "weight_scale"], w[p + "input_scale"],
                    w.get(p + "bias"))  # fmt: skip
        return (w[p + "weight"], w[p + "weight_scale"], w.get(p + "pre_quant_scale"),
                self.group_size, w.get(p + "weight_zero"), w.get(p + "bias"))  # fmt: skip

    def _attend(
        self, i: int, q, meta: AttnMetadata, k_cache, v_cache, attn_kw, rows=None, add=None
    ) -> torch.Tensor:
        """Attention of the rotated q over the paged cache, then the o projection. rows: only
        the sampling rows' queries, each its sequence's last, attend (one query per sequence:
        the decode kernel). add: the o projection adds into the residual stream (AddOut)."""
        c, ops = self.cfg, self.ops
        if rows is not None:
            q, meta = q.index_select(0, rows.rows), rows.meta(meta, k_cache.shape[1])
        with self._rows_scope(rows):
            o = ops.paged_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                meta.query_start_loc,
                self.scale,
                c.sliding_window,
                max_query_len=meta.max_query_len,
                max_context_len=meta.max_context_len,
                num_decodes=meta.num_decodes,
                **attn_kw,
            )
            ak = {"add": add} if add is not None else {}
            out = self.linears[f"layers.{i}.attn.o"](o.reshape(-1, self.q_size), **ak)  # [T, D]
        if self.comm is not None:
            self.comm.all_reduce_(out)
        return out

    def _mlp(
        self, i: int, x: torch.Tensor, norm: NormIn | None = None, add: AddOut | None = None
    ) -> torch.Tensor:
        """Layer i's MLP. norm / add: gate_up normalizes x (the residual stream) as it loads
        it, down adds into the residual stream and returns it (plugins/gemm/fused_norm.py)."""
        p = f"layers.{i}.mlp."
        nk = {"norm": norm} if norm is not None else {}
        ak = {"add": add} if add is not None else {}
        gate_up = self.linears[p + "gate_up"](x, **nk)  # [T, 2I / tp]
        if self.swiglu_down is not None:
            out = self.swiglu_down(gate_up, self.w[p + "down.weight"], **ak)
        elif self.fp8_swiglu_down is not None:
            w = self.w
            out = self.fp8_swiglu_down(
                gate_up,
                w[p + "down.weight"],
                w[p + "down.weight_scale"],
                w[p + "down.input_scale"],
                w.get(p + "down.bias"),
                out_dtype=self.dtype,
                **ak,
            )
        elif self.fp8_fused:
            act = self.ops.swiglu_quant_fp8(gate_up, self.w[p + "down.input_scale"])
            out = self.linears[p + "down"](act, **ak)
        elif self.quant_mode == "int4_awq":  # the W4A16 GEMV applies SwiGLU as it loads x
            out = self.linears[p + "down"](gate_up, gated=True, **ak)
        else:
            out = self.linears[p + "down"](self.ops.swiglu(gate_up), **ak)
        if self.comm is not None:
            self.comm.all_reduce_(out)  # row-parallel down: [T, D] partial sums
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, D]. tp: each rank looks up its vocabulary slice (other ids
        give zeros), then the ranks sum."""
        if self.comm is None:
            return self.ops.embedding(input_ids, self.w["embed.weight"])
        local = input_ids.long() - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_local)  # [T]
        h = self.ops.embedding(local.clamp(0, self.vocab_local - 1), self.w["embed.weight"])
        h = h.masked_fill(~mine[:, None], 0)
        return self.comm.all_reduce_(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv: KVCache,
        rows: SampleRows | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, D] (normed); with `rows`, those
        of the sampling rows only, [R, D] (see SampleRows)."""
        with pdl.scope(self.uses_pdl(input_ids.shape[0])):
            if self.decode_writes_v and rows is not None:  # its new_v: every row attends
                return self._forward(input_ids, positions, meta, kv, None).index_select(
                    0, rows.rows
                )
            return self._forward(input_ids, positions, meta, kv, rows)

    def uses_pdl(self, rows: int) -> bool:
        """Whether a pass over `rows` tokens launches the PDL kernel variants: in PDL engines,
        small decode batches only. Those chain ~290 short GEMV-bound kernels (H200, batch 1,
        BF16, in one process: +3.4% and +4.3% in two calls); larger passes run cuBLAS
        GEMMs, which never signal early, and measured 0.3-1.6% slower with PDL at batch 64
        (docs/performance.md)."""
        return self.ops.pdl and rows <= PDL_MAX_ROWS

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv: KVCache,
        rows: SampleRows | None,
    ) -> torch.Tensor:
        c, w = self.cfg, self.w
        h = self._embed(input_ids)
        residual = h
        x = self._norm(h, None, w["layers.0.attn_norm.weight"], "layers.0.attn.qkv")
        # the first n_fold layers fold their norms into the GEMVs (plugins/gemm/fused_norm.py):
        # o and down add into the residual stream, gate_up and the next QKV normalize it as
        # they load it, from the sums of squares the GEMV before left (a slot each)
        n_fold = self._folded_layers(input_ids.shape[0])
        sums = new_sums(2 * n_fold, input_ids.shape[0], h.device) if n_fold else None
        eps, norm_in = c.rms_norm_eps, None  # norm_in: what the next QKV normalizes x with
        for i in range(c.num_layers):
            if i < n_fold:
                nxt = w[f"layers.{i + 1}.attn_norm.weight"]
                residual = self._attention(i, x, positions, meta, kv, None, norm_in,
                                           AddOut(residual, sums[2 * i]))  # fmt: skip
                mlp_in = NormIn(w[f"layers.{i}.mlp_norm.weight"], eps, sums[2 * i])
                residual = self._mlp(i, residual, mlp_in, AddOut(residual, sums[2 * i + 1]))
                x, norm_in = residual, NormIn(nxt, eps, sums[2 * i + 1])
                continue
            # the last layer: QKV and the KV write for every row, the rest for the sampling rows
            last = rows if i + 1 == c.num_layers else None
            a = self._attention(i, x, positions, meta, kv, last, norm_in)
            norm_in = None
            if last is not None:
                residual = residual.index_select(0, last.rows)
            with self._rows_scope(last):
                x, residual = self._norm(
                    a, residual, w[f"layers.{i}.mlp_norm.weight"], f"layers.{i}.mlp.gate_up"
                )
                m = self._mlp(i, x)
                if i + 1 < c.num_layers:
                    nxt = f"layers.{i + 1}.attn"
                    x, residual = self._norm(m, residual, w[nxt + "_norm.weight"], nxt + ".qkv")
                else:
                    x, residual = self._norm(m, residual, w["final_norm.weight"], None)
        return x

    def _folded_layers(self, tokens: int) -> int:
        """How many layers of a pass over `tokens` run with their norms folded into the GEMVs:
        all but the last (whose o projection, MLP and final norm may run on the sampling rows
        alone), when the pass is small enough (`fold_rows`)."""
        return self.cfg.num_layers - 1 if 0 < tokens <= self.fold_rows else 0

    def _rows_scope(self, rows: SampleRows | None):
        """Work on the sampling rows alone runs as a decode step of R rows does (PDL or not):
        the same kernel variants, which the engine's bundle holds. None: the pass's own scope."""
        if rows is None:
            return contextlib.nullcontext()
        return pdl.scope(self.uses_pdl(rows.rows.shape[0]))

    def _norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        consumer: str | None,
    ):
        """RMSNorm of x (of residual + x, returning the new residual too, when `residual` is
        given). FP8 engines return it quantized for linear `consumer` (None: the final norm,
        whose output `logits` takes in the model dtype, quantized lm_head or not)."""
        eps = self.cfg.rms_norm_eps
        if self.fp8_fused and consumer is not None:
            scale = self.w[consumer + ".input_scale"]
            return self.ops.rms_norm_quant_fp8(x, weight, eps, scale, residual)
        if residual is None:
            return self.ops.rms_norm(x, weight, eps)
        return self.ops.add_rms_norm(x, residual, weight, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D] -> float32 logits [B, V] (`step_logits`, widened)."""
        return self.step_logits(hidden).float()

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D] -> logits [B, V] in the lm_head's output dtype (the model dtype: lm_head
        runs in it, as HF does, or in FP8 when the engine quantized it). Sampling reads these:
        widening every row to float32 cost a decode step at batch 512 ~0.3 ms on the H200 (a
        [512, 128k] copy and a max over it twice the size), and the argmax of the widened
        values is the same (bf16/fp16 -> fp32 is exact).

        tp: every rank must call it with the same B (a collective); each computes its
        vocabulary slice and all gather the full (padded) vocabulary."""
        if self.comm is None:
            with pdl.scope(self.uses_pdl(hidden.shape[0])):
                return self._lm_head(hidden, self.lm_head)
        if hidden.shape[0] == 0:
            return hidden.new_zeros(0, self.cfg.vocab_size)
        local = self._lm_head(hidden, self.lm_head)  # [B, V_padded / tp]
        return self.comm.all_gather_last_dim(local)[:, : self.cfg.vocab_size]
