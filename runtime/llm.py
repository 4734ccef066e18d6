"""Text in, text out: an engine dir plus its own tokenizer (no separate tokenizer dir needed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import load_engine
from .errors import EngineError, IngotError
from .executor import Executor
from .types import FinishReason, Request, SamplingParams

TOKENIZER_DIR = "tokenizer"


def load_tokenizer(engine_dir: Path):
    """The source model's tokenizer, as `AutoTokenizer.from_pretrained(source_dir)` builds it."""
    from transformers import AutoTokenizer

    path = Path(engine_dir) / TOKENIZER_DIR
    if not path.is_dir():
        raise EngineError(
            f"{engine_dir} has no {TOKENIZER_DIR}/ folder",
            "rebuild the engine from a checkpoint made by `ingot convert-checkpoint`",
        )
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise EngineError(
            f"cannot load the engine's tokenizer: {e}", "re-run convert-checkpoint and build-engine"
        ) from None


@dataclass
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None = None


class LLM:
    """Loads an engine and serves text prompts with inflight batching.

    A tensor-parallel engine (tp_size > 1) spawns ranks 1..tp-1 (runtime/distributed.py);
    this process is rank 0. Call `close()` (or use `with`) to stop them; a failed rank stops
    the whole group and surfaces here as one EngineError naming it. tp_timeouts: a
    `distributed.TPTimeouts` (tp > 1 only). pipeline: see `Executor.step` (tp 1 only).
    """

    def __init__(
        self,
        engine_dir: Path,
        device: torch.device | None = None,
        num_kv_blocks: int | None = None,
        policy: str = "guaranteed_no_evict",
        kv_fraction: float = 0.9,
        tp_timeouts=None,
        pipeline: bool = True,
    ) -> None:
        self.group = None
        self.engine = load_engine(Path(engine_dir), device)
        self.tokenizer = load_tokenizer(engine_dir)
        kw = dict(
            num_kv_blocks=num_kv_blocks,
            policy=policy,
            kv_cache_free_gpu_memory_fraction=kv_fraction,
            pipeline=pipeline,
        )
        tp = self.engine.config.tp_size
        if tp == 1:
            self.executor = Executor(self.engine, device, **kw)
            return
        from .distributed import RankGroup

        if device is None:
            device = torch.device("cpu" if self.engine.config.target == "cpu" else "cuda:0")
        self.group = RankGroup(Path(engine_dir), tp, device, kw, tp_timeouts)
        self.executor = self._guard(
            lambda: Executor(self.engine, device, comm=self.group.join(), **kw)
        )

    def _guard(self, fn):
        """tp: run fn; any failure stops every rank and names the one that failed."""
        if self.group is None:
            return fn()
        try:
            return fn()
        except IngotError:
            self.group.terminate()
            raise
        except Exception as e:  # noqa: BLE001 - a broken collective or a rank-0 bug
            raise self.group.failure(e) from None

    def close(self) -> None:
        """Stop the other ranks (tp > 1); nothing to do for tp 1. Idempotent."""
        if self.group is not None:
            self.group.close()
            self.group = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "group", None) is not None:
            try:
                self.group.terminate()
            except Exception:  # noqa: BLE001 - interpreter shutdown; the ranks are daemons
                pass

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _stop_check(self, req: Request) -> bool:
        words = req.params.stop_words
        return bool(words) and any(w in self.decode(req.output_ids) for w in words)

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """Serve all prompts together. on_text(prompt_index, new_text) streams text deltas."""
        reqs = [self.executor.add_request(self.tokenizer(p).input_ids, params) for p in prompts]
        index = {r.request_id: i for i, r in enumerate(reqs)}
        shown: dict[int, int] = {}

        def on_token(req: Request, _tok: int) -> None:
            if on_text is None:
                return
            text = self.decode(req.output_ids)
            # NOTE: hold back a trailing replacement char: a multi-byte character is incomplete.
            if text.endswith("\ufffd"):
                return
            start = shown.get(req.request_id, 0)
            if len(text) > start:
                on_text(index[req.request_id], text[start:])
                shown[req.request_id] = len(text)

        self._guard(lambda: self.executor.run_until_done(on_token, self._stop_check))
        return [self._completion(p, r) for p, r in zip(prompts, reqs, strict=True)]

    def _completion(self, prompt: str, req: Request) -> Completion:
        text = self.decode(req.output_ids)
        if req.finish_reason == FinishReason.STOP:
            cut = min((text.find(w) for w in req.params.stop_words if w in text), default=-1)
            text = text[:cut] if cut >= 0 else text
        return Completion(prompt, text, list(req.output_ids), req.finish_reason, req.error)
