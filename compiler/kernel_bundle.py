"""Ahead-of-time kernels for a GPU engine: find every Triton launch the engine will make, compile
each for the target SM and pack them into the rank file (`ingot.plugins.aot`).

The launches are found by a dry run of the decoder on the `meta` device with the engine's
chosen plugins: Triton launches are recorded (dtype, alignment and integer classes are all
the JIT specializes on) instead of run, so this works without a GPU (cross-build). The dry run
covers the batch shapes the runtime uses: every decode and prefill bucket of the CUDA graphs,
and eager prefill batches whose token counts hit each integer class (1, multiple of 16, other).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ingot.plugins.attention.layout import SHORT_CONTEXT
from ingot.plugins.attention.reference import ANY_DECODES
from ingot.runtime.config import BuildConfig, ModelConfig, QuantConfig
from ingot.runtime.cuda_graphs import (
    SHORT_TIER_MAX_BATCH,
    batch_buckets,
    prefill_buckets,
    prefill_graph_keys,
)
from ingot.runtime.engine import EngineConfig, PluginChoice
from ingot.runtime.errors import ConfigError
from ingot.runtime.kv_cache import KVCache
from ingot.runtime.model import AttnMetadata, Decoder, Ops, trailing_decodes

BLOB_NAME = "triton_kernels"
PREFILL_TOKENS = (1, 2, 16, 17, 32, 33)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Inside: every `kernel[grid](...)` is recorded as a KernelSpec and not launched."""
    from triton.runtime.jit import JITFunction

    from ingot.plugins.aot import KernelSpec

    specs: list = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        specs.append(KernelSpec.of(self, *args, **kwargs))

    JITFunction.run = record
    try:
        yield specs
    finally:
        JITFunction.run = original


def _meta_batch(
    lens_new: list[int],
    width: int,
    max_ctx: int,
    max_query_len: int | None = None,
    num_decodes: int = 0,
) -> AttnMetadata:
    i32 = dict(dtype=torch.int32, device="meta")
    b, t = len(lens_new), sum(lens_new)
    return AttnMetadata(
        slot_mapping=torch.empty(t, **i32),
        block_tables=torch.empty(b, width, **i32),
        context_lens=torch.empty(b, **i32),
        query_start_loc=torch.empty(b + 1, **i32),
        max_context_len=max_ctx,
        max_query_len=max_query_len or max(lens_new),
        # as the executor's eager steps (captured prefill graphs pass max_query_len and theirs)
        num_decodes=num_decodes if max_query_len else trailing_decodes(lens_new),
    )


def dry_run_decoder(
    model: ModelConfig,
    quant: QuantConfig,
    build: BuildConfig,
    plugins: tuple[PluginChoice, ...],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> tuple[Decoder, KVCache]:
    """The engine's decoder and a KV cache on the `meta` device (launches are recorded, not run)."""
    cfg = EngineConfig(model=model, quant=quant, build=build, plugins=plugins, rank_files={})
    weights = {n: torch.empty(s, dtype=dt, device="meta") for n, (s, dt) in shapes.items()}
    dtype = weights["embed.weight"].dtype
    try:
        decoder = Decoder(model, weights, Ops(cfg), quant)
    except (AttributeError, NotImplementedError) as e:
        raise ConfigError(
            f"target {build.target} cannot run this engine yet: {e}", "build with --target cpu"
        ) from None
    kv_dtype = torch.float8_e4m3fn if quant.kv_cache_dtype == "fp8" else dtype
    return decoder, KVCache(model, 4, build.tokens_per_block, kv_dtype, torch.device("meta"))


def engine_launches(
    model: ModelConfig,
    quant: QuantConfig,
    build: BuildConfig,
    plugins: tuple[PluginChoice, ...],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> list:
    """KernelSpecs of every Triton launch a GPU engine of these configs makes at run time."""
    decoder, kv = dry_run_decoder(model, quant, build, plugins, shapes)
    width = -(-build.max_seq_len // build.tokens_per_block)
    table_tokens = width * build.tokens_per_block
    batches: list[tuple[list[int], int, int | None, int]] = [
        ([1] * b, build.max_seq_len, None, 0) for b in batch_buckets(build.max_batch_size)
    ]
    if build.max_seq_len > SHORT_CONTEXT:  # the small-batch decode graphs' short tier
        batches += [([1] * b, SHORT_CONTEXT, None, 0) for b in batch_buckets(build.max_batch_size)
                    if b <= SHORT_TIER_MAX_BATCH]  # fmt: skip
    for t in PREFILL_TOKENS:
        if t <= build.max_num_tokens:
            batches.append(([t], t, None, 0))  # one prompt
            batches.append(([t, 1], t + 1, None, 0))  # a chunk beside a decode
    if build.max_batch_size > 2:  # a chunk beside many decodes (their own decode launch)
        batches.append(([16] + [1] * (build.max_batch_size - 1), build.max_seq_len, None, 0))
    # the captured prefill graphs: a lone prompt (+ padding); several sequences (+ padding),
    # whose one-query sequences the decode kernel takes wherever they sit
    keys = prefill_graph_keys(prefill_buckets(build.max_num_tokens), build.max_batch_size)
    for tier, b in keys:
        lens, nd = ([1, b - 1], 0) if tier == 1 else ([0] * tier + [b], ANY_DECODES)
        batches.append((lens, table_tokens, b, nd))
    with recorded_launches() as specs:
        for new, max_ctx, max_q, nd in batches:
            t = sum(new)
            meta = _meta_batch(new, width, max_ctx, max_q, nd)
            ids = torch.empty(t, dtype=torch.int32, device="meta")
            hidden = decoder.forward(ids, ids, meta, kv)
            decoder.logits(hidden[: len(new)])
    return list(dict.fromkeys(specs))


def build_kernel_bundle(
    model: ModelConfig,
    quant: QuantConfig,
    build: BuildConfig,
    plugins: tuple[PluginChoice, ...],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    host_stubs_from: str | None = None,
) -> tuple[bytes, int]:
    """(bundle blob, number of kernel binaries in it) compiled for build.target."""
    from ingot.plugins.aot import bundle_manifest, compile_bundle

    specs = engine_launches(model, quant, build, plugins, shapes)
    blob = compile_bundle(specs, build.target, host_stubs_from=host_stubs_from)
    return blob, len(bundle_manifest(blob)["kernels"])
