"""Inflight batching: the C++ scheduler plans each step, the decoder runs it, the sampler picks.

Requests can be added between any two steps; each step mixes prefill chunks and decodes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .distributed import PLAN_KEYS
from .engine import LoadedEngine
from .errors import ConfigError, RequestError
from .inflight import Launched, TokenReadback, chained_rows, patch_inputs, reads_tokens_of
from .kernels import KERNELS_FILE, install_engine_kernels
from .kv_cache import KVCache
from .memory import num_kv_blocks as default_num_kv_blocks
from .model import AttnMetadata, Decoder, Ops, SampleRows, trailing_decodes
from .sampler import RequestSampler, greedy_tokens
from .scheduler import Scheduler, SchedulerConfig
from .step_inputs import StepInputs
from .timing import Lap
from .types import FinishReason, Request, SamplingParams

# what an eager step reads on the device (one packed copy: step_inputs.py)
_DEVICE_INPUTS = tuple(k for k in PLAN_KEYS if k != "prompt_ranges")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Where a call to `step` spends its wall time on the host: planning and launching a step when
# none is in flight ("start"); taking that step's tokens as placeholders, planning and launching
# the next one ("next", pipelined only); waiting for the step's tokens ("readback": the device's
# time, when nothing else is queued); bookkeeping ("settle": finish checks, callbacks, the
# scheduler's update). Pipelined, the device runs the next step during "settle" and the next
# call's "next"; unpipelined, it sits idle for all but "readback".
STEP_PHASES = ("start", "next", "readback", "settle")

# Called after each step with (request, new token id); text-level stop checks live above this.
TokenCallback = Callable[[Request, int], None]
StopCheck = Callable[[Request], bool]


class Executor:
    """Serves many requests at once from one loaded engine.

    num_kv_blocks: size of the KV pool; default: on the CPU enough for max_batch_size sequences
    of max_seq_len tokens (within a budget), on a GPU `kv_cache_free_gpu_memory_fraction` of
    the memory left after weights and activations. policy: "guaranteed_no_evict" or
    "max_utilization" (the C++ core's admission policies). cuda_graphs: replay decode steps
    from graphs captured per batch-size bucket, and steps with prompt tokens from graphs per
    token bucket and sequence tier (cuda_graphs.PREFILL_GRAPH_TIERS; GPU only; tp 1 only for
    now).
    comm: this rank's tensor-parallel group (runtime/distributed.py), None for tp 1; rank 0
    schedules, broadcasts each plan and samples, the other ranks run `follow`. pipeline: launch
    the next step before reading this one's tokens back, when its sampling allows (`step`).
    """

    def __init__(
        self,
        engine: LoadedEngine,
        device: torch.device | None = None,
        num_kv_blocks: int | None = None,
        policy: str = "guaranteed_no_evict",
        enable_prefix_reuse: bool = True,
        kv_cache_free_gpu_memory_fraction: float = 0.9,
        cuda_graphs: bool = True,
        comm=None,
        pipeline: bool = True,
    ) -> None:
        cfg = engine.config
        tp = comm.world if comm is not None else 1
        if cfg.tp_size != tp:
            raise ConfigError(
                f"the engine is built for tp_size {cfg.tp_size}, this executor runs {tp} rank(s)",
                "serve it with `ingot run-engine` or `ingot.runtime.llm.LLM`",
            )
        self.comm = comm
        self.config = cfg
        self.device = device or torch.device("cpu" if cfg.target == "cpu" else "cuda")
        self._inputs = StepInputs(self.device)
        self.dtype = _DTYPES[cfg.model.dtype]
        self.kernels = 0
        # seconds per load phase (benchmarks report them; the GPU phases end synchronized)
        self.load_seconds: dict[str, float] = {}
        lap = Lap(self.load_seconds, self.device)
        if self.device.type == "cuda":
            # NOTE: before any kernel launches, so every launch finds its ahead-of-time binary.
            self.kernels = install_engine_kernels(engine.dir, cfg.rank_files.get(KERNELS_FILE))
        lap("kernels")
        weights = {n: t.to(self.device) for n, t in engine.weights().items()}
        lap("weights")
        self.decoder = Decoder(cfg.model, weights, Ops(cfg), cfg.quant, comm=comm)
        b = cfg.build
        # Quantization: an FP8 KV cache stores float8_e4m3fn (K/V divided by per-layer scales).
        kv_dtype = torch.float8_e4m3fn if cfg.quant.kv_cache_dtype == "fp8" else self.dtype
        if num_kv_blocks is None:
            num_kv_blocks = default_num_kv_blocks(
                cfg.model, b, kv_dtype, self.device, kv_cache_free_gpu_memory_fraction, tp=tp,
                prefill_graphs=cuda_graphs and comm is None,
            )  # fmt: skip
        if comm is not None:
            # NOTE: every rank's pool must hold each block id rank 0's scheduler hands out.
            num_kv_blocks = comm.min_int(num_kv_blocks)
        if num_kv_blocks <= 0:
            raise ConfigError(f"the KV cache needs at least one block, got {num_kv_blocks}")
        self.kv = KVCache(
            cfg.model, num_kv_blocks, b.tokens_per_block, kv_dtype, self.device, tp=tp
        )
        lap("kv_pool")
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
        self.graphs = self.prefill_graphs = None
        if cuda_graphs and self.device.type == "cuda" and comm is None:
            from .cuda_graphs import (
                SHORT_TIER,
                DecodeGraphs,
                PrefillGraphs,
                prefill_buckets,
                prefill_graph_keys,
            )

            width = self.scheduler.config.max_blocks_per_seq
            self.graphs = DecodeGraphs(
                self.decoder, self.kv, b.max_batch_size, width, b.max_seq_len, self.device,
                SHORT_TIER,
            )  # fmt: skip
            lap("decode_graphs")
            buckets = prefill_buckets(b.max_num_tokens)
            if buckets:
                keys = prefill_graph_keys(buckets, b.max_batch_size)
                self.prefill_graphs = PrefillGraphs(self.decoder, self.kv, keys, width, self.device)
            lap("prefill_graphs")
        engine.wait_verified()
        lap("checksum_wait")
        if comm is not None:
            comm.min_int(0)  # NOTE: a barrier: every rank has loaded and verified its shard
        self.eos_ids = set(cfg.model.eos_token_ids)
        self.requests: dict[int, Request] = {}
        self._samplers: dict[int, RequestSampler] = {}
        self._argmax_ids: set[int] = set()  # requests whose token is the plain argmax
        self._ids = itertools.count()
        # host seconds of the last step by STEP_PHASES (benchmarks sum them by kind of step)
        self.step_phases = (0.0, 0.0, 0.0, 0.0)
        # the step a call read back: entries, prefill entries, KV tokens, new tokens
        self.last_step = (0, 0, 0, 0)
        self.pipeline = pipeline
        self.chained_steps = 0  # decodes launched from the previous step's argmax on the device
        self._inflight: Launched | None = None
        self._readback = TokenReadback(b.max_batch_size, self.device)

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
        sampler = self._samplers[req.request_id] = RequestSampler(params, self.device)
        if sampler.is_greedy and params.repetition_penalty == 1.0:
            self._argmax_ids.add(req.request_id)
        return req

    def cancel(self, req: Request) -> None:
        if self.scheduler.cancel(req.request_id):
            req.finish_reason = FinishReason.CANCELLED
            self._forget(req.request_id)

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a launched step not read back yet."""
        return self._inflight is not None or self.scheduler.has_unfinished()

    def _forget(self, rid: int) -> None:
        self.requests.pop(rid, None)
        self._samplers.pop(rid, None)
        self._argmax_ids.discard(rid)

    def step(
        self, on_token: TokenCallback | None = None, stop_check: StopCheck | None = None
    ) -> list[Request]:
        """Run one scheduler step; returns the requests that finished in it.

        Pipelined (`pipeline`, one rank): when every row of the step samples greedily, the
        scheduler takes the step's tokens as placeholders while the device is still computing
        them, plans the next step and, when its decodes continue this step's sequences, launches
        it with their input tokens gathered on the device from this step's argmax. Then the host
        reads this step's tokens, puts them into the scheduler, and does the step's bookkeeping
        while the device runs the next step. A request that stops on EOS or a stop check is
        cancelled then; the extra token the next step computed for it is dropped. Tokens,
        callbacks and finishes are exactly those of an unpipelined run, one call later at most:
        a call returns what finished in the step it read back, and `has_unfinished()` stays
        true while a launched step is unread."""
        t0 = time.perf_counter()
        cur, self._inflight = self._inflight, None
        if cur is None:
            plan = self.scheduler.schedule()
            if plan.num_seqs == 0:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress with requests pending")
                return []
            cur = self._launch(plan)
        t1 = time.perf_counter()
        held = None
        if self._speculable(cur):
            n = cur.num_seqs
            cur.finished = self.scheduler.update(np.zeros(n, np.int32), np.zeros(n, np.int8))
            cur.speculative = True
            plan = self.scheduler.schedule()
            if plan.num_seqs:
                src = chained_rows(plan, cur)
                if src is not None:
                    self._inflight = self._launch(plan, cur.argmax, src)
                    self.chained_steps += 1
                elif not reads_tokens_of(plan, cur):
                    self._inflight = self._launch(plan)  # e.g. a prompt's next chunk
                else:
                    held = plan  # its inputs include tokens the host has not read yet
        t2 = time.perf_counter()
        toks = self._read_tokens(cur)
        t3 = time.perf_counter()
        if cur.speculative:
            self.scheduler.set_last_tokens(cur.seq_ids, np.asarray(toks, np.int32))
            if held is not None:
                patch_inputs(held, cur, toks)
                self._inflight = self._launch(held)
        done = self._settle(cur, toks, on_token, stop_check)
        self.last_step = cur.shape
        self.step_phases = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return done

    def _launch(
        self, plan, prev: torch.Tensor | None = None, src: np.ndarray | None = None
    ) -> Launched:
        """Start a planned step on the device (and its tokens' copy to the host). prev/src: a
        chained step: the input token of its i-th decode is prev[src[i]] on the device."""
        self._stamp_first_launch(plan)
        rows = np.nonzero(np.asarray(plan.samples))[0]
        seq_ids = np.asarray(plan.seq_ids)[rows]
        reqs = [self.requests.get(i) for i in seq_ids.tolist()]
        ids = None
        if prev is not None:
            if np.array_equal(src, np.arange(len(src))):  # the same sequences, in order
                ids = prev[: len(src)].to(torch.int32)
            else:
                # NOTE: from pinned memory: a copy from pageable memory may wait for the device
                idx = torch.from_numpy(src)
                idx = idx.pin_memory() if self.device.type == "cuda" else idx
                ids = prev.index_select(0, idx.to(self.device, non_blocking=True))
                ids = ids.to(torch.int32)
        logits, argmax = self._logits(plan, rows, ids)
        plain = self._argmax_ids
        if argmax is None and any(r is not None and r.request_id in plain for r in reqs):
            argmax = greedy_tokens(logits)
        ctx = np.asarray(plan.context_lens)
        step = Launched(
            plan.num_seqs,
            rows,
            seq_ids,
            ctx[rows],
            reqs,
            logits,
            argmax,
            shape=(
                plan.num_seqs,
                plan.num_prefill,
                int(np.sum(ctx, dtype=np.int64)),
                int(plan.query_start_loc[-1]),
            ),
        )
        self._readback.start(step)
        return step

    def _stamp_first_launch(self, plan) -> None:
        """Stamp the requests whose prompt starts in this step (its prefill entries come
        first; a preempted request's recompute keeps its first stamp)."""
        if not plan.num_prefill:
            return
        now, seq_ids = time.perf_counter(), plan.seq_ids
        computed = np.asarray(plan.num_computed)[: plan.num_prefill]
        for b in np.flatnonzero(computed == 0).tolist():
            req = self.requests.get(int(seq_ids[b]))
            if req is not None and req.first_launch is None:
                req.first_launch = now

    def _speculable(self, step: Launched) -> bool:
        """Whether the scheduler may take this step's tokens before they are known: every
        sampling row greedy (its token comes from the device argmax alone), one rank."""
        if not self.pipeline or self.comm is not None:
            return False
        plain = self._argmax_ids
        return all(not self._served(r) or r.request_id in plain for r in step.reqs) and (
            step.argmax is not None or not step.reqs
        )

    def _served(self, req: Request | None) -> bool:
        """Whether a step's row still belongs to a live request (not cancelled, finished or
        dead when the step was launched)."""
        return req is not None and self.requests.get(req.request_id) is req

    def _read_tokens(self, step: Launched) -> list[int]:
        """One token per sampling row: greedy rows from the device argmax, the others drawn
        on the host by their request's sampler."""
        reqs = step.reqs
        if not reqs:
            return []
        plain = self._argmax_ids
        out = self._readback.tokens(step) if step.argmax is not None else [0] * len(reqs)
        for j, req in enumerate(reqs):
            if not self._served(req) or req.request_id in plain:
                continue  # no longer served (cancelled after the launch), or greedy
            seen = None
            if req.params.repetition_penalty != 1.0:
                seen = torch.tensor(req.prompt_ids + req.output_ids)
            logits = step.logits[j].float().cpu()
            out[j] = self._samplers[req.request_id].sample(logits, seen)
        return out

    def _settle(
        self,
        step: Launched,
        toks: list[int],
        on_token: TokenCallback | None,
        stop_check: StopCheck | None,
    ) -> list[Request]:
        """The host's part of a read-back step: tokens appended, EOS and stop checks, callbacks,
        the scheduler told (or, for a speculative step, stopped requests cancelled)."""
        reqs = step.reqs
        live = self.requests
        # NOTE: per-row Python kept to appends and set lookups (scripts/bench_host_step.py:
        # at batch 256 the host work of a step fell from 121 to ~60 us on the CPU dev machine)
        ok = [self._served(r) for r in reqs]
        for req, tok, keep in zip(reqs, toks, ok, strict=True):
            if keep:
                req.output_ids.append(tok)
        stops: dict[int, int] = {}  # row -> EOS / STOP
        eos = self.eos_ids
        for j in [j for j, tok in enumerate(toks) if tok in eos]:
            if ok[j] and not reqs[j].params.ignore_eos:
                stops[j] = FinishReason.EOS
        if stop_check is not None or on_token is not None:
            for j, (req, tok, keep) in enumerate(zip(reqs, toks, ok, strict=True)):
                if not keep:
                    continue
                if stop_check is not None and j not in stops and stop_check(req):
                    stops[j] = FinishReason.STOP
                if on_token is not None:
                    on_token(req, tok)
        if step.speculative:
            ended = dict(step.finished)  # finished by length in the speculative update
            for j, reason in stops.items():
                rid = reqs[j].request_id
                if rid in ended or self.scheduler.cancel(rid):
                    ended[rid] = reason  # EOS / STOP wins over LENGTH, as unpipelined
            finished = list(ended.items())
        else:
            new_tokens = np.zeros(step.num_seqs, dtype=np.int32)
            finish = np.zeros(step.num_seqs, dtype=np.int8)
            new_tokens[step.rows] = toks
            for j, reason in stops.items():
                finish[step.rows[j]] = reason
            finished = self.scheduler.update(new_tokens, finish)
        done = []
        for rid, reason in finished:
            req = live.get(rid)
            if req is None:
                continue
            req.finish_reason = FinishReason(reason)
            self._forget(rid)
            done.append(req)
        return done

    def _logits(
        self, plan, rows: np.ndarray, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the step: logits [len(rows), V] (on the device, in the lm_head's output
        dtype: `Decoder.step_logits`) of the sampling rows, and their argmax when a captured
        graph already computed it. ids: the input tokens of the plan's trailing decodes on the
        device (int32), instead of the plan's."""
        if plan.num_prefill == 0 and self.graphs is not None and self.graphs.can_run(plan.num_seqs):
            return self.graphs.run(plan, ids)  # decode: every row samples
        pg = self.prefill_graphs
        if pg is not None and pg.can_run(plan, rows) and not self._wants_prompt_logits(plan):
            return pg.run(plan, rows, ids)  # prompts (time to first token), a few decodes beside
        # eager: the step's arrays (tp: broadcast to every rank, which run the same forward)
        qsl = np.asarray(plan.query_start_loc)
        ranges = self._prompt_ranges(plan)
        arrays = {
            "input_ids": plan.input_ids,
            "positions": plan.positions,
            "slot_mapping": plan.slot_mapping,
            "block_tables": plan.block_tables,
            "context_lens": plan.context_lens,
            "query_start_loc": qsl,
            "last": qsl[rows + 1] - 1,
            "last_seq": rows,
            "prompt_ranges": np.array([(s, n) for _, s, n in ranges], np.int32).reshape(-1, 2),
        }
        if self.comm is not None:
            self.comm.broadcast_plan(arrays)
        prompt_logits, logits = self.run_plan(arrays, ids)
        for (req, _, _), lg in zip(ranges, prompt_logits, strict=True):
            req.prompt_logits.append(lg.cpu())
        return logits, None

    def _wants_prompt_logits(self, plan) -> bool:
        seq_ids = np.asarray(plan.seq_ids)
        return any(self.requests[int(i)].params.return_prompt_logits for i in seq_ids)

    def run_plan(
        self, arrays: dict[str, np.ndarray], ids: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One eager step from its arrays (distributed.PLAN_KEYS) -> (float32 logits of each
        prompt range, logits [R, V] of the sampling rows in the lm_head's output dtype). tp:
        every rank calls it with the same (broadcast) arrays; the collectives are inside.
        ids: the input tokens of the step's trailing decodes on the device (a chained step),
        replacing the array's."""
        q_lens = np.diff(arrays["query_start_loc"])
        d = self._inputs.put({k: arrays[k] for k in _DEVICE_INPUTS})
        if ids is not None:  # the trailing decodes' tokens
            d["input_ids"][d["input_ids"].shape[0] - ids.shape[0] :].copy_(ids)
        meta = AttnMetadata(
            slot_mapping=d["slot_mapping"],
            block_tables=d["block_tables"],
            context_lens=d["context_lens"],
            query_start_loc=d["query_start_loc"],
            max_context_len=int(np.max(arrays["context_lens"])),
            max_query_len=int(np.max(q_lens)),
            num_decodes=trailing_decodes(q_lens),
        )
        if len(arrays["prompt_ranges"]) or len(arrays["last"]) == len(arrays["input_ids"]):
            # every row's hidden state: prompt logits, or a step where every row samples
            hidden = self.decoder.forward(d["input_ids"], d["positions"], meta, self.kv)
            prompt = [
                self.decoder.logits(hidden[s : s + n]) for s, n in arrays["prompt_ranges"].tolist()
            ]
            return prompt, self.decoder.step_logits(hidden[d["last"].long()])
        rows = SampleRows(d["last"], d["last_seq"])
        hidden = self.decoder.forward(d["input_ids"], d["positions"], meta, self.kv, rows)
        return [], self.decoder.step_logits(hidden)

    def follow(self, on_step: Callable[[int], None] | None = None) -> None:
        """tp ranks > 0: run rank 0's broadcast steps until it sends "stop".
        on_step(step) runs before each step (a test hook)."""
        for step in itertools.count(1):
            arrays = self.comm.broadcast_plan(None)
            if arrays is None:
                return
            if on_step is not None:
                on_step(step)
            self.run_plan(arrays)

    def _prompt_ranges(self, plan) -> list[tuple[Request, int, int]]:
        """(request, first row, rows) of the prompt positions whose logits are kept."""
        qsl = np.asarray(plan.query_start_loc)
        seq_ids, start = np.asarray(plan.seq_ids), np.asarray(plan.num_computed)
        out = []
        for b in range(plan.num_prefill):
            req = self.requests[int(seq_ids[b])]
            if req.params.return_prompt_logits and start[b] < len(req.prompt_ids):
                n = min(int(qsl[b + 1] - qsl[b]), len(req.prompt_ids) - int(start[b]))
                out.append((req, int(qsl[b]), n))
        return out

    def run_until_done(
        self, on_token: TokenCallback | None = None, stop_check: StopCheck | None = None
    ) -> None:
        while self.has_unfinished():
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
