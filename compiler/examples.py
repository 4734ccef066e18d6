"""Tiny random Hugging Face models, made offline, for tests and the README quickstart.

python -m ingot.compiler.examples --family llama --out /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch

FAMILY_CHOICES = ("llama", "mistral", "qwen2", "qwen3")
CORPUS = Path(__file__).parent / "data" / "example_corpus.txt"
TOKENIZER_VOCAB = 512

# Special tokens in the style of each family's real tokenizer: (specials, bos, eos, adds bos).
_SPECIALS: dict[str, tuple[tuple[str, ...], str | None, str, bool]] = {
    "llama": (
        ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|end_of_text|>",
        True,
    ),
    "mistral": (("<unk>", "<s>", "</s>"), "<s>", "</s>", True),
    "qwen": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|endoftext|>", False),
}


def _tokenizer_style(family: str) -> str:
    return "qwen" if family in ("qwen2", "qwen3") else family


@functools.cache
def _trained_tokenizer_json(style: str) -> str:
    """Byte-level BPE trained on the shipped corpus; cached per process to keep tests fast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials, bos, _eos, add_bos = _SPECIALS[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    if add_bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def make_tokenizer(family: str) -> Any:
    """The HF tokenizer object a model of `family` ships with (trained offline, tiny vocab)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    style = _tokenizer_style(family)
    specials, bos, eos, _ = _SPECIALS[style]
    raw = _trained_tokenizer_json(style)
    if style == "qwen":
        model = json.loads(raw)["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        return Qwen2Tokenizer(
            vocab=model["vocab"], merges=merges, unk_token=None, eos_token=eos, pad_token=eos
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(raw),
        bos_token=bos,
        eos_token=eos,
        unk_token=specials[0] if style == "mistral" else None,
    )


def _hf_config(
    family: str,
    vocab_size: int,
    bos: int | None,
    eos: int,
    rope_llama3: bool,
    tie: bool | None,
    dtype: str,
    overrides: dict[str, Any],
) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }[family]
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # larger init: logits are not near-ties
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype=dtype,
    )
    if family == "qwen3":
        kw["head_dim"] = 32  # NOTE: != hidden/heads on purpose, as in real Qwen3 models
    if family == "mistral":
        kw["sliding_window"] = None
    if rope_llama3:
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    kw.update(overrides)
    return cls(**kw)


def make_tiny_hf_model(
    family: str,
    out_dir: Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    sharded: bool = False,
    rope_scaling_llama3: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random HF model (config, safetensors, tokenizer) of `family` to `out_dir`."""
    from transformers import AutoModelForCausalLM

    if family not in FAMILY_CHOICES:
        raise ValueError(f"family {family!r} not in {FAMILY_CHOICES}")
    out_dir = Path(out_dir)
    tokenizer = make_tokenizer(family)
    bos = tokenizer.bos_token_id
    config = _hf_config(
        family,
        len(tokenizer),
        bos,
        tokenizer.eos_token_id,
        rope_scaling_llama3,
        tie_word_embeddings,
        dtype,
        config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    # HF small-std init leaves norms at 1 and biases at 0; perturb them so conversion bugs show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    kw: dict[str, Any] = {"max_shard_size": "100KB"} if sharded else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kw)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random HF model for ingot demos.")
    parser.add_argument("--family", choices=FAMILY_CHOICES, default="llama")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args(argv)
    path = make_tiny_hf_model(
        args.family, args.out, dtype=args.dtype, seed=args.seed, sharded=args.sharded
    )
    print(f"wrote a tiny {args.family} model to {path}")


if __name__ == "__main__":
    main()
