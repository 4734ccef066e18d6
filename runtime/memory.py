"""How many KV blocks fit: the CPU gets a fixed budget, a GPU a fraction of what is free."""

from __future__ import annotations

import torch

from .config import BuildConfig, ModelConfig
from .errors import ConfigError

CPU_KV_BUDGET_BYTES = 4 << 30
# the largest captured prefill graph (cuda_graphs.LARGE_PREFILL; kept here to avoid the import)
PREFILL_GRAPH_TOKENS = 2048


def kv_bytes_per_token(cfg: ModelConfig, element_size: int, tp: int = 1) -> int:
    """K and V of one token over all layers, on one rank (tp: num_kv_heads / tp heads)."""
    return cfg.num_layers * 2 * (cfg.kv_size // tp) * element_size


def kv_bytes_per_block(
    cfg: ModelConfig, tokens_per_block: int, dtype: torch.dtype, tp: int = 1
) -> int:
    """One block of one rank's KV pool (tp: num_kv_heads / tp heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return tokens_per_block * kv_bytes_per_token(cfg, elem, tp)


def token_activation_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """Upper bound of the live activations of a step of `tokens` tokens (no logits)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = (
        cfg.qkv_size + 2 * cfg.intermediate_size + cfg.intermediate_size + 4 * cfg.hidden_size
    )
    return tokens * per_token * elem


def activation_bytes(
    cfg: ModelConfig, build: BuildConfig, dtype: torch.dtype, prefill_graphs: bool = True
) -> int:
    """Upper bound of one step's live activations at max_num_tokens (plus float32 logits), and,
    when the executor captures prefill graphs (`prefill_graphs`), of their memory pool (their
    largest bucket, runtime/cuda_graphs.py, and every graph's logits), which eager steps cannot
    reuse."""
    logits = build.max_batch_size * cfg.vocab_size * 4
    graphs = 0
    if prefill_graphs:
        from .cuda_graphs import prefill_buckets, prefill_graph_keys  # NOTE: it imports this

        keys = prefill_graph_keys(prefill_buckets(build.max_num_tokens), build.max_batch_size)
        graphs = token_activation_bytes(cfg, min(PREFILL_GRAPH_TOKENS, build.max_num_tokens), dtype)
        graphs += sum(s for s, _ in keys) * cfg.vocab_size * 4  # each graph's own logits
    return token_activation_bytes(cfg, build.max_num_tokens, dtype) + 2 * logits + graphs


def num_kv_blocks(
    cfg: ModelConfig,
    build: BuildConfig,
    dtype: torch.dtype,
    device: torch.device,
    free_gpu_memory_fraction: float = 0.9,
    tp: int = 1,
    prefill_graphs: bool = True,
) -> int:
    """KV pool size. CPU: enough for max_batch_size full sequences, within a fixed budget.
    GPU: `free_gpu_memory_fraction` of the memory left after weights and one step's
    activations (call after the weights are on the device), up to twice what max_batch_size
    full sequences need (the rest of that headroom keeps finished prefixes for reuse).
    tp: sized for one rank's shard of the pool (the ranks then agree on the smallest).
    prefill_graphs: the executor captures prefill graphs (tp 1 with CUDA graphs on), whose pool
    is reserved before the KV pool."""
    # NOTE: checked on the CPU too, where it is unused: a wrong flag is refused everywhere
    if not 0.0 < free_gpu_memory_fraction <= 1.0:
        raise ConfigError(
            f"--kv-cache-free-gpu-memory-fraction must be in (0, 1], got {free_gpu_memory_fraction}"
        )
    per_block = kv_bytes_per_block(cfg, build.tokens_per_block, dtype, tp)
    blocks_per_seq = -(-build.max_seq_len // build.tokens_per_block)
    if device.type != "cuda":
        return min(
            build.max_batch_size * blocks_per_seq,
            max(blocks_per_seq, CPU_KV_BUDGET_BYTES // per_block),
        )
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    act = activation_bytes(cfg, build, dtype, prefill_graphs)
    budget = int((free - act) * free_gpu_memory_fraction)
    blocks = budget // per_block
    if blocks < blocks_per_seq:
        raise ConfigError(
            f"out of GPU memory: the KV cache needs {blocks_per_seq * per_block / 2**30:.2f} GiB for "
            f"one {build.max_seq_len}-token sequence but {max(budget, 0) / 2**30:.2f} GiB is left",
            "raise --kv-cache-free-gpu-memory-fraction, or rebuild with a smaller --max-seq-len "
            "or --max-num-tokens",
        )
    return int(min(blocks, 2 * build.max_batch_size * blocks_per_seq))
