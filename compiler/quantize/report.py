"""The accuracy report stored in every quantized checkpoint and engine.

On held-out text (the last quarter of the shipped calib.txt, which calibration from the shipped
text never reads), the unquantized HF model (transformers, fp32 on the CPU / the model dtype on
a GPU) gives reference logits at every position; ingot's own quantized CPU path (the engine
layout and the plugins' CPU references, exactly what a CPU engine runs) gives the quantized
ones. Reported: top-1 agreement of the next-token predictions and the mean (and max) KL
divergence KL(P_ref || P_quant) per position, in nats. The same figures for ingot's
unquantized path at the checkpoint dtype are the baseline (what the dtype alone costs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from ingot.runtime.config import BuildConfig, ModelConfig, QuantConfig

from .layout import repack_for_engine

Progress = Callable[[str, int, int], None]
WINDOWS, WINDOW_LEN, BLOCK = 4, 128, 16


def held_out_windows(tokenizer: Any, text: str) -> list[torch.Tensor]:
    from .calibrate import token_windows

    return token_windows(tokenizer, text, WINDOWS, WINDOW_LEN)


@torch.no_grad()
def reference_logits(model: Any, windows: list[torch.Tensor], progress: Progress) -> list:
    """Unquantized HF logits [L, V] float32 (CPU) per window; run before calibration."""
    device = next(model.parameters()).device
    out = []
    for i, ids in enumerate(windows):
        progress("scoring the unquantized model", i, len(windows))
        out.append(model(ids.to(device)).logits[0].float().cpu())
    return out


@torch.no_grad()
def ingot_logits(
    cfg: ModelConfig, quant: QuantConfig, tensors: dict[str, torch.Tensor], windows: list
) -> list[torch.Tensor]:
    """Logits [L, V] float32 per window from ingot's CPU plugins: one prefill of every window
    (packed, as the runtime batches prompts), so each quantized weight is dequantized once."""
    from ingot.compiler.build import rope_tables, select_plugins
    from ingot.runtime.engine import EngineConfig
    from ingot.runtime.kv_cache import KVCache
    from ingot.runtime.model import AttnMetadata, Decoder, Ops

    lens = [w.shape[1] for w in windows]
    n_max, total = max(lens), sum(lens)
    build = BuildConfig(len(windows), n_max, total, BLOCK, "cpu")
    plugins = select_plugins("cpu", cfg, build, tactics="default", quant=quant)
    ops = Ops(EngineConfig(cfg, quant, build, plugins, rank_files={}))
    weights = {n: repack_for_engine(quant, n, t) for n, t in tensors.items()}
    weights.update(rope_tables(cfg, n_max))
    dec = Decoder(cfg, weights, ops, quant)
    kv_dtype = (
        torch.float8_e4m3fn if quant.kv_cache_dtype == "fp8" else weights["embed.weight"].dtype
    )
    i32 = dict(dtype=torch.int32)
    # window i owns blocks [i * per, (i + 1) * per) of one cache
    per = -(-n_max // BLOCK)
    kv = KVCache(cfg, per * len(windows), BLOCK, kv_dtype, torch.device("cpu"))
    tables = torch.arange(per * len(windows), **i32).view(len(windows), per)
    slots = torch.cat([i * per * BLOCK + torch.arange(n, **i32) for i, n in enumerate(lens)])
    meta = AttnMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=torch.tensor(lens, **i32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(lens)], **i32),
        max_context_len=n_max,
        max_query_len=n_max,
    )
    ids = torch.cat([w[0] for w in windows]).to(torch.int32)
    positions = torch.cat([torch.arange(n, **i32) for n in lens])
    logits = dec.logits(dec.forward(ids, positions, meta, kv))
    return list(logits.split(lens))


def compare(reference: list[torch.Tensor], ours: list[torch.Tensor]) -> dict[str, float]:
    """Top-1 agreement and KL(P_ref || P_ours) per position (mean, max) over all windows."""
    ref, got = torch.cat(reference), torch.cat(ours).float()  # [P, V]
    lp_ref, lp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).clamp_min(0)  # [P]
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    return {
        "top1_agreement": round(float(agree), 6),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
    }


def accuracy_report(
    cfg: ModelConfig,
    quant: QuantConfig,
    tensors: dict[str, torch.Tensor],
    unquantized: dict[str, torch.Tensor],
    windows: list[torch.Tensor],
    reference: list[torch.Tensor],
    progress: Progress,
) -> dict[str, Any]:
    progress("accuracy report", 0, 2)
    base = compare(reference, ingot_logits(cfg, QuantConfig(), unquantized, windows))
    progress("accuracy report", 1, 2)
    rep = compare(reference, ingot_logits(cfg, quant, tensors, windows))
    progress("accuracy report", 2, 2)
    return {
        **rep,
        "held_out": {
            "text": "shipped calib.txt (last 25%)",
            "sequences": len(windows),
            "positions": int(sum(w.shape[1] for w in windows)),
        },
        "quantized": f"ingot CPU reference path ({quant.mode}, kv {quant.kv_cache_dtype}, "
        f"{cfg.dtype} activations)",
        "unquantized_baseline": base,
    }
