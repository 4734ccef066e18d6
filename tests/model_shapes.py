"""Model configs at production shapes for tests that need no weights (planning, dry runs)."""

from __future__ import annotations

from ingot.runtime.config import ModelConfig

LLAMA_3_1_8B = ModelConfig(
    architecture="LlamaForCausalLM",
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
)
