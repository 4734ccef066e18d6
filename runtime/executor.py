"""Inflight batching: the C++ scheduler plans each step, the decoder runs it, the sampler picks.

Requests can be added between any two steps; each step mixes prefill chunks and decodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .engine import LoadedEngine
from .errors import ConfigError, RequestError
from .kv_cache import KVCache, kv_bytes_per_block
from .model import AttnMetadata, Decoder, Ops
from .sampler import RequestSampler
from .scheduler import Scheduler, SchedulerConfig
from .types import FinishReason, Request, SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 4 << 30

# Called after each step with (request, new token id); text-level stop checks live above this.
TokenCallback = Callable[[Request, int], None]
StopCheck = Callable[[Request], bool]


class Executor:
    """Serves many requests at once from one loaded engine.

    num_kv_blocks: size of the KV pool; default is enough for max_batch_size sequences of
    max_seq_len tokens (bounded by a memory budget). policy: "guaranteed_no_evict" or
    "max_utilization" (the C++ core's admission policies).
    """

    def __init__(
        self,
        engine: LoadedEngine,
        device: torch.device | None = None,
        num_kv_blocks: int | None = None,
        policy: str = "guaranteed_no_evict",
        enable_prefix_reuse: bool = True,
    ) -> None:
        cfg = engine.config
        self.config = cfg
        self.device = device or torch.device("cpu" if cfg.target == "cpu" else "cuda")
        self.dtype = _DTYPES[cfg.model.dtype]
        weights = {n: t.to(self.device) for n, t in engine.weights().items()}
        self.decoder = Decoder(cfg.model, weights, Ops(cfg))
        b = cfg.build
        blocks_per_seq = -(-b.max_seq_len // b.tokens_per_block)
        if num_kv_blocks is None:
            per_block = kv_bytes_per_block(cfg.model, b.tokens_per_block, self.dtype)
            num_kv_blocks = min(
                b.max_batch_size * blocks_per_seq,
                max(blocks_per_seq, CPU_KV_BUDGET_BYTES // per_block),
            )
        if num_kv_blocks <= 0:
            raise ConfigError(f"the KV cache needs at least one block, got {num_kv_blocks}")
        self.kv = KVCache(cfg.model, num_kv_blocks, b.tokens_per_block, self.dtype, self.device)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_kv_blocks,
                tokens_per_block=b.tokens_per_block,
                max_batch_size=b.max_batch_size,
                max_num_tokens=b.max_num_tokens,
                max_seq_len=b.max_seq_len,
                policy=policy,
                enable_prefix_reuse=enable_prefix_reuse,
            )
        )
        self.eos_ids = set(cfg.model.eos_token_ids)
        self.requests: dict[int, Request] = {}
        self._samplers: dict[int, RequestSampler] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request. An invalid one comes back finished as REJECTED with `error` set;
        it never disturbs the others."""
        req = Request(next(self._ids), list(prompt_ids), params)
        try:
            if not req.prompt_ids:
                raise RequestError("the prompt is empty", "give at least one token")
            self.scheduler.add_request(req.request_id, req.prompt_ids, params.max_new_tokens)
        except RequestError as e:
            req.finish_reason, req.error = FinishReason.REJECTED, e.one_line()
            return req
        self.requests[req.request_id] = req
        self._samplers[req.request_id] = RequestSampler(params, self.device)
        return req

    def cancel(self, req: Request) -> None:
        if self.scheduler.cancel(req.request_id):
            req.finish_reason = FinishReason.CANCELLED
            self._forget(req.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _forget(self, rid: int) -> None:
        self.requests.pop(rid, None)
        self._samplers.pop(rid, None)

    def step(
        self, on_token: TokenCallback | None = None, stop_check: StopCheck | None = None
    ) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        if plan.num_seqs == 0:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        dev = self.device
        qsl = torch.from_numpy(np.asarray(plan.query_start_loc)).to(dev)
        meta = AttnMetadata(
            slot_mapping=torch.from_numpy(np.asarray(plan.slot_mapping)).to(dev),
            block_tables=torch.from_numpy(np.asarray(plan.block_tables)).to(dev),
            context_lens=torch.from_numpy(np.asarray(plan.context_lens)).to(dev),
            query_start_loc=qsl,
            max_context_len=int(np.max(plan.context_lens)),
            is_decode=plan.num_prefill == 0,
        )
        ids = torch.from_numpy(np.asarray(plan.input_ids)).to(dev)
        pos = torch.from_numpy(np.asarray(plan.positions)).to(dev)
        hidden = self.decoder.forward(ids, pos, meta, self.kv)
        self._keep_prompt_logits(plan, hidden)
        samples = np.asarray(plan.samples).astype(bool)
        rows = np.nonzero(samples)[0]
        new_tokens = np.zeros(plan.num_seqs, dtype=np.int32)
        finish = np.zeros(plan.num_seqs, dtype=np.int8)
        if rows.size:
            last = torch.from_numpy(np.asarray(plan.query_start_loc)[rows + 1] - 1).to(dev)
            logits = self.decoder.logits(hidden[last.long()]).cpu()
            seq_ids = np.asarray(plan.seq_ids)
            for j, b in enumerate(rows.tolist()):
                req = self.requests[int(seq_ids[b])]
                seen = None
                if req.params.repetition_penalty != 1.0:
                    seen = torch.tensor(req.prompt_ids + req.output_ids)
                tok = self._samplers[req.request_id].sample(logits[j], seen)
                req.output_ids.append(tok)
                new_tokens[b] = tok
                if tok in self.eos_ids and not req.params.ignore_eos:
                    finish[b] = FinishReason.EOS
                elif stop_check is not None and stop_check(req):
                    finish[b] = FinishReason.STOP
                if on_token is not None:
                    on_token(req, tok)
        done = []
        for rid, reason in self.scheduler.update(new_tokens, finish):
            req = self.requests[rid]
            req.finish_reason = FinishReason(reason)
            self._forget(rid)
            done.append(req)
        return done

    def _keep_prompt_logits(self, plan, hidden: torch.Tensor) -> None:
        """Logits of every computed prompt position, for requests that asked (scoring)."""
        qsl = np.asarray(plan.query_start_loc)
        seq_ids, start = np.asarray(plan.seq_ids), np.asarray(plan.num_computed)
        for b in range(plan.num_prefill):
            req = self.requests[int(seq_ids[b])]
            if req.params.return_prompt_logits and start[b] < len(req.prompt_ids):
                n = min(int(qsl[b + 1] - qsl[b]), len(req.prompt_ids) - int(start[b]))
                rows = hidden[int(qsl[b]) : int(qsl[b]) + n]
                req.prompt_logits.append(self.decoder.logits(rows).cpu())

    def run_until_done(
        self, on_token: TokenCallback | None = None, stop_check: StopCheck | None = None
    ) -> None:
        while self.scheduler.has_unfinished():
            self.step(on_token, stop_check)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        on_token: TokenCallback | None = None,
    ) -> list[Request]:
        """Serve all prompts together; returns their requests in order (finished)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        self.run_until_done(on_token)
        return reqs
