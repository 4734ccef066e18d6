"""Tensor parallelism: how a model splits over ranks, the rank group, its collectives.

tp 1 never touches this module's process group: no group, no collectives, no extra ops.
With tp > 1, rank 0 runs in the caller's process (it owns the C++ scheduler, samples and
prints); ranks 1..tp-1 are spawned processes that run `Executor.follow` (NCCL on GPUs, each
rank on cuda:rank; gloo on the CPU). Each step rank 0 broadcasts the plan's int32 arrays as
one tensor after a small header; every rank then runs the same forward pass, all-reducing
after the attention output projection and the MLP down projection, and the vocabulary-parallel
embedding and lm_head (`Decoder`). A rank that fails ends the group: rank 0 names it in one
line (`RankGroup.failure`) and the launcher terminates the others.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .config import ModelConfig
from .errors import ConfigError, EngineError, IngotError

# The plan arrays rank 0 broadcasts each step, in this order (all int32; 1-D or 2-D).
PLAN_KEYS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "context_lens",
    "query_start_loc",
    "last",  # [R] rows of the hidden states that sample
    "last_seq",  # [R] their sequences (model.SampleRows)
    "prompt_ranges",  # [P, 2] (first row, rows) of prompt positions whose logits are kept
)
_CMD_STOP, _CMD_STEP = 0, 1
_HEADER = 1 + 2 * len(PLAN_KEYS)  # command, then (rows, cols) per array; cols -1: 1-D
# NOTE: test-only hook (tests/test_tp.py): "R:S" makes rank R > 0 raise at its step S
# ("R:S:hang": hang there instead).
TEST_FAIL_ENV = "INGOT_TEST_FAIL_RANK"


def _no_multicast() -> None:
    """NVLink multicast stays off (NCCL, PyTorch symmetric memory, NVSHMEM): it can take a
    shared host's GPUs out of service."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ConfigError unless `tp` ranks can split `cfg` by head."""
    if tp < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp}")
    if cfg.num_heads % tp or cfg.num_kv_heads % tp or cfg.intermediate_size % tp:
        raise ConfigError(
            f"--tp-size {tp} must divide the model's num_heads {cfg.num_heads}, num_kv_heads "
            f"{cfg.num_kv_heads} and intermediate_size {cfg.intermediate_size}",
            "choose a tp size that divides all three",
        )


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (embedding/lm_head rows past it are 0)."""
    return -(-vocab_size // tp) * tp


def vocab_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int]:
    """(first id, number of ids) of rank's vocabulary slice."""
    local = padded_vocab(vocab_size, tp) // tp
    return rank * local, local


def local_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank computes with (heads, intermediate and vocab split by tp); for
    sizing kernels and tactics only. tp 1 returns `cfg` itself."""
    if tp == 1:
        return cfg
    import dataclasses

    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=cfg.num_kv_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=padded_vocab(cfg.vocab_size, tp) // tp,
    )


class Comm:
    """One rank's view of the group: rank, world, and the collectives the decoder needs."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks in place; returns it."""
        dist.all_reduce(t)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """t: [..., N] on every rank -> [..., world * N], rank r's part at r * N."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_plan(self, arrays: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        """Rank 0 passes the step's arrays (None: stop); every rank gets them back (None on stop).

        Two broadcasts: an int64 header (command, each array's shape), then one int32 tensor
        holding every array back to back.
        """
        header = torch.zeros(_HEADER, dtype=torch.int64)
        flat = None
        if self.rank == 0:
            if arrays is not None:
                parts = [np.ascontiguousarray(arrays[k], dtype=np.int32) for k in PLAN_KEYS]
                header[0] = _CMD_STEP
                for j, a in enumerate(parts):
                    header[1 + 2 * j] = a.shape[0]
                    header[2 + 2 * j] = a.shape[1] if a.ndim == 2 else -1
                flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in parts]))
        h = header.to(self.device)
        dist.broadcast(h, src=0)
        header = h.cpu()
        if int(header[0]) == _CMD_STOP:
            return None
        shapes = [
            (int(header[1 + 2 * j]),)
            if header[2 + 2 * j] < 0
            else (int(header[1 + 2 * j]), int(header[2 + 2 * j]))
            for j in range(len(PLAN_KEYS))
        ]
        total = sum(int(np.prod(s)) for s in shapes)
        buf = flat.to(self.device) if flat is not None else torch.empty(total, dtype=torch.int32)
        buf = buf.to(self.device)
        dist.broadcast(buf, src=0)
        if self.rank == 0:
            return arrays
        data, out, at = buf.cpu().numpy(), {}, 0
        for k, s in zip(PLAN_KEYS, shapes, strict=True):
            n = int(np.prod(s))
            out[k] = data[at : at + n].reshape(s)
            at += n
        return out

    def stop(self) -> None:
        """Rank 0: end the other ranks' follower loops."""
        self.broadcast_plan(None)


def init_comm(rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> Comm:
    """Join the group on 127.0.0.1:port (NCCL for a GPU device, gloo for the CPU)."""
    _no_multicast()
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return Comm(rank, world, device)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TPTimeouts:
    """Seconds: for every rank to load and join, and for any one collective (a rank waits
    this long for the next step while rank 0 is idle)."""

    init_s: float = 300.0
    collective_s: float = 1800.0


def _one_line(e: BaseException) -> str:
    if isinstance(e, IngotError):
        return e.one_line()
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _follower_main(
    rank: int,
    world: int,
    port: int,
    engine_dir: str,
    device_type: str,
    executor_kw: dict[str, Any],
    timeouts: TPTimeouts,
    conn: connection.Connection,
) -> None:
    """Entry point of ranks 1..world-1: load, join, follow rank 0's plans until stop."""
    _no_multicast()
    try:
        device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        from .engine import load_engine
        from .errors import IngotWarning
        from .executor import Executor

        # rank 0 has said it once (one host: one GPU model)
        warnings.simplefilter("ignore", IngotWarning)
        engine = load_engine(Path(engine_dir), device, rank=rank)
        conn.send(("ready", rank))
        comm = init_comm(rank, world, port, device, timeouts.collective_s)
        ex = Executor(engine, device, comm=comm, **executor_kw)
        ex.follow(_test_failure(rank))
        dist.destroy_process_group()
        conn.send(("done", rank))
    except BaseException as e:  # noqa: BLE001 - every failure must reach rank 0 as one line
        try:
            conn.send(("error", rank, _one_line(e)))
            conn.close()
        finally:
            # NOTE: no cleanup that could block on the broken group; the OS closes the sockets,
            # which fails rank 0's pending collective at once.
            os._exit(1)


def _test_failure(rank: int) -> Callable[[int], None] | None:
    """NOTE: test-only (tests/test_tp.py): INGOT_TEST_FAIL_RANK="R:S[:hang]" fails (or hangs)
    rank R at its step S."""
    spec = os.environ.get(TEST_FAIL_ENV)
    if not spec:
        return None
    r, s, *mode = spec.split(":")
    if int(r) != rank:
        return None

    def check(step: int) -> None:
        if step == int(s):
            if mode == ["hang"]:
                time.sleep(3600)
            raise RuntimeError(f"injected test failure at step {step}")

    return check


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


class RankGroup:
    """Launcher: spawns ranks 1..world-1 (this process is rank 0), joins them, and on any
    failure stops every rank and names the one that failed."""

    def __init__(
        self,
        engine_dir: Path,
        world: int,
        device: torch.device,
        executor_kw: dict[str, Any],
        timeouts: TPTimeouts | None = None,
    ) -> None:
        self.world, self.device = world, device
        self.timeouts = timeouts or TPTimeouts()
        self.comm: Comm | None = None
        # NOTE: before any rank initializes NCCL; spawned ranks inherit it too.
        _no_multicast()
        port = _free_port()
        ctx = get_context("spawn")
        self.procs, self.conns = {}, {}
        for r in range(1, world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_follower_main,
                args=(
                    r,
                    world,
                    port,
                    str(engine_dir),
                    device.type,
                    executor_kw,
                    self.timeouts,
                    send,
                ),
                name=f"ingot-tp-rank{r}",
                daemon=True,
            )
            p.start()
            send.close()
            self.procs[r], self.conns[r] = p, recv
        self._port = port
        self._errors: dict[int, str] = {}

    def join(self) -> Comm:
        """Wait until every rank has loaded its engine, then form the group (as rank 0)."""
        waiting = set(self.procs)
        deadline = time.monotonic() + self.timeouts.init_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.failure(None, f"ranks {sorted(waiting)} did not start in time")
            for conn in connection.wait([self.conns[r] for r in waiting], timeout=min(left, 1.0)):
                r = next(k for k, c in self.conns.items() if c is conn)
                msg = self._recv(r)
                if msg is None or msg[0] == "error":
                    raise self.failure(None)
                waiting.discard(r)
        try:
            self.comm = init_comm(
                0, self.world, self._port, self.device, self.timeouts.collective_s
            )
        except Exception as e:  # noqa: BLE001
            raise self.failure(e) from None
        return self.comm

    def _recv(self, r: int) -> tuple | None:
        try:
            msg = self.conns[r].recv()
        except (EOFError, OSError):
            code = self.procs[r].exitcode
            if code:
                self._errors.setdefault(r, f"exited with code {code}")
            return None
        if msg[0] == "error":
            self._errors.setdefault(r, msg[2])
        return msg

    def failure(self, exc: BaseException | None, why: str | None = None) -> EngineError:
        """Stop every rank; the error naming the rank that failed first, and why."""
        # A timed-out collective: the other rank is alive and stuck, it will not report.
        deadline = time.monotonic() + (0.5 if exc is not None and _is_timeout(exc) else 5.0)
        # A follower writes its error before it exits, and its exit is what failed rank 0's
        # collective: give the message a moment to arrive.
        while time.monotonic() < deadline:
            for r, conn in self.conns.items():
                if conn.poll():
                    self._recv(r)
                elif self.procs[r].exitcode not in (0, None):
                    self._errors.setdefault(r, f"exited with code {self.procs[r].exitcode}")
            if self._errors or (exc is None and why is not None):
                break
            time.sleep(0.05)
        self.terminate()
        if self._errors:
            r = next(iter(self._errors))  # the first to report: the others only lost it
            return EngineError(
                f"tensor-parallel rank {r} of {self.world} failed: {self._errors[r]}",
                "every rank was stopped",
            )
        what = why or (_one_line(exc) if exc is not None else "unknown error")
        if why is None and exc is not None and _is_timeout(exc):
            what = (
                f"a collective did not complete within {self.timeouts.collective_s:g} s "
                f"(another rank hung?): {what}"
            )
        return EngineError(
            f"tensor-parallel rank 0 of {self.world} failed: {what}", "every rank was stopped"
        )

    def terminate(self) -> None:
        """Kill every follower still running (idempotent) and leave the group."""
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self._leave()

    def _leave(self) -> None:
        if self.comm is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the group may already be broken
                pass
        self.comm = None

    def close(self) -> None:
        """Send "stop", let the followers exit, then make sure none is left."""
        if self.comm is not None:
            try:
                self.comm.stop()
                for p in self.procs.values():
                    p.join(30.0)
            except Exception:  # noqa: BLE001 - a broken group is torn down below anyway
                pass
        self.terminate()
