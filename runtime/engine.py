"""Engine dir: config.json + rank{N}.engine + tokenizer/. Reading checks everything first.

The engine config names the format and its version, the ingot version that wrote it, the
target, the model/quant/build configs, the plugins with versions and tactics, and a sha256 per
rank file. The compiler writes it through `write_engine_config`; the runtime reads it here.
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ingot.plugins import get_spec

from .config import BuildConfig, ModelConfig, QuantConfig
from .engine_format import EngineFile
from .errors import EngineError, IngotWarning
from .integrity import CHUNK_BYTES, chunks_match, sha256_file
from .version import CHECKPOINT_FORMAT, ENGINE_FORMAT_VERSION, INGOT_VERSION

ENGINE_FORMAT = "ingot-engine"
REBUILD = "rebuild it with `ingot build-engine`"
# extra's key for the name of the GPU that timed the engine's tactics (absent: cross-built
# from the default tactic table, or built before it was recorded)
TACTICS_TIMED_ON = "tactics_timed_on"


@dataclass(frozen=True)
class PluginChoice:
    """One op as built into an engine: plugin version, tactic (name and parameters, so the
    engine alone can rebuild it), the timings that chose it, and optionally the use site it is
    for (e.g. gemm at "attn.qkv"; None: every use of the op)."""

    name: str
    version: int
    tactic: str | None = None
    params: dict[str, Any] | None = None
    site: str | None = None
    timings_ms: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "site": self.site,
            "tactic": self.tactic,
            "params": self.params,
            "timings_ms": self.timings_ms,
        }


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    quant: QuantConfig
    build: BuildConfig
    plugins: tuple[PluginChoice, ...]
    rank_files: dict[str, str]
    # per rank file: sha256 of each CHUNK_BYTES chunk, so loading verifies on all cores
    rank_chunks: dict[str, list[str]] | None = None
    tp_size: int = 1
    ingot_version: str = INGOT_VERSION
    format_version: int = ENGINE_FORMAT_VERSION
    extra: dict[str, Any] | None = None

    @property
    def target(self) -> str:
        return self.build.target

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": ENGINE_FORMAT,
            "format_version": self.format_version,
            "ingot_version": self.ingot_version,
            "target": self.build.target,
            "tp_size": self.tp_size,
            "model": self.model.to_dict(),
            "quant": self.quant.to_dict(),
            "build": self.build.to_dict(),
            "plugins": [p.to_dict() for p in self.plugins],
            "rank_files": self.rank_files,
            "rank_chunks": {"chunk_bytes": CHUNK_BYTES, "files": self.rank_chunks or {}},
            "extra": self.extra or {},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        return cls(
            model=ModelConfig.from_dict(d["model"]),
            quant=QuantConfig.from_dict(d["quant"]),
            build=BuildConfig.from_dict(d["build"]),
            plugins=tuple(PluginChoice(**p) for p in d["plugins"]),
            rank_files=dict(d["rank_files"]),
            rank_chunks=_chunks_from(d.get("rank_chunks")),
            tp_size=int(d.get("tp_size", 1)),
            ingot_version=d["ingot_version"],
            format_version=int(d["format_version"]),
            extra=d.get("extra") or {},
        )


def write_engine_config(engine_dir: Path, cfg: EngineConfig) -> None:
    (Path(engine_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def read_engine_config(engine_dir: Path) -> EngineConfig:
    """Parse and check config.json (format, version, plugins). Does not touch rank files."""
    engine_dir = Path(engine_dir)
    path = engine_dir / "config.json"
    if not engine_dir.is_dir():
        raise EngineError(
            f"engine dir {engine_dir} does not exist", "build one with `ingot build-engine`"
        )
    if not path.is_file():
        raise EngineError(f"{engine_dir} has no config.json, so it is not an ingot engine", REBUILD)
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise EngineError(f"{path} is not valid JSON ({e})", REBUILD) from None
    if isinstance(d, dict) and d.get("format") == CHECKPOINT_FORMAT:
        raise EngineError(
            f"{engine_dir} is an ingot checkpoint, not an engine",
            f"build an engine from it: `ingot build-engine --checkpoint-dir {engine_dir} "
            "--output-dir DIR`",
        )
    if not isinstance(d, dict) or d.get("format") != ENGINE_FORMAT:
        raise EngineError(
            f"{engine_dir} is not an ingot engine (format is {d.get('format')!r})"
            if isinstance(d, dict)
            else f"{path} is not an engine config",
            REBUILD,
        )
    version = d.get("format_version")
    if not isinstance(version, int) or version > ENGINE_FORMAT_VERSION:
        raise EngineError(
            f"engine format version {version} (written by ingot {d.get('ingot_version')}) is newer "
            f"than this ingot {INGOT_VERSION} reads (up to {ENGINE_FORMAT_VERSION})",
            f"upgrade ingot, or {REBUILD} from this version",
        )
    try:
        cfg = EngineConfig.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise EngineError(f"engine config is incomplete or malformed ({e})", REBUILD) from None
    for p in cfg.plugins:
        try:
            get_spec(p.name, p.version)
        except KeyError as e:
            raise EngineError(f"engine needs {e.args[0]}", f"{REBUILD} with this ingot") from None
    return cfg


def rank_file_name(rank: int) -> str:
    return f"rank{rank}.engine"


def _chunks_from(d: dict[str, Any] | None) -> dict[str, list[str]] | None:
    """Chunk digests are only usable when they were made with this reader's chunk size."""
    if not d or d.get("chunk_bytes") != CHUNK_BYTES:
        return None
    return {name: list(digests) for name, digests in d.get("files", {}).items()}


def verify_rank_files(
    engine_dir: Path, cfg: EngineConfig, rank: int | None = None, full: bool = False
) -> None:
    """Raise EngineError if a rank file is missing or its checksum differs from the config.
    rank: check only that rank's file (and the shared ones, e.g. kernels.bin); None: all.
    full: the whole-file sha256 (one core); otherwise the per-chunk digests where the engine
    has them (every core; the same bytes either way)."""
    expected = {rank_file_name(r) for r in range(cfg.tp_size)}
    missing = sorted(expected - cfg.rank_files.keys())
    if missing:
        raise EngineError(
            f"engine config lists no {', '.join(missing)} (tp_size {cfg.tp_size})", REBUILD
        )
    for name, digest in cfg.rank_files.items():
        if rank is not None and name in expected and name != rank_file_name(rank):
            continue
        path = Path(engine_dir) / name
        if not path.is_file():
            raise EngineError(f"engine rank file {name} is missing", REBUILD)
        chunks = (cfg.rank_chunks or {}).get(name)
        ok = chunks_match(path, chunks) if chunks and not full else sha256_file(path) == digest
        if not ok:
            raise EngineError(
                f"engine rank file {name} fails its checksum (altered or corrupt)", REBUILD
            )


def check_target(cfg: EngineConfig, device: torch.device) -> None:
    """Refuse an engine built for another device than the one we run on; warn when its
    tactics were timed on another GPU model."""
    check_device(cfg, device)
    if cfg.target != "cpu":
        warn_if_tuned_elsewhere(cfg, torch.cuda.get_device_name(device))


def check_device(cfg: EngineConfig, device: torch.device) -> None:
    """EngineError unless `device` (and this machine's GPU) is what the engine was built for."""
    target = cfg.target
    if target == "cpu":
        if device.type != "cpu":
            raise EngineError(
                "engine was built for the CPU but a GPU run was asked for",
                "rebuild with `ingot build-engine --target auto` on the GPU machine",
            )
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise EngineError(
            f"engine was built for GPU target {target} but no CUDA GPU is available",
            "run it on that GPU, or rebuild with `ingot build-engine --target cpu`",
        )
    major, minor = torch.cuda.get_device_capability(device)
    here = f"sm_{major}{minor}"
    if here != target:
        raise EngineError(
            f"engine was built for {target} but this GPU is {here}",
            "rebuild with `ingot build-engine --target auto` on this GPU",
        )


def warn_if_tuned_elsewhere(cfg: EngineConfig, gpu_name: str) -> None:
    """Warn (IngotWarning) when the engine's tactics were timed on another GPU model of the
    same SM: it runs, but its kernels were picked for that GPU (e.g. the H100 and the H200
    differ in bandwidth: the fastest tactics and PDL prefetch differed between them)."""
    timed_on = (cfg.extra or {}).get(TACTICS_TIMED_ON)
    if timed_on and timed_on != gpu_name:
        warnings.warn(
            IngotWarning(
                f"engine tactics were timed on {timed_on}, this GPU is {gpu_name}: it runs, "
                "but its kernels may not be the fastest here (rebuild with "
                "`ingot build-engine --target auto` on this GPU)"
            ),
            stacklevel=2,
        )


@dataclass
class LoadedEngine:
    """A checked engine config and its memory-mapped rank file. The rank file's checksum is
    verified in a background thread (it overlaps the weight upload); call `wait_verified()`
    before serving."""

    dir: Path
    config: EngineConfig
    rank_file: EngineFile
    _verification: Future | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: self.rank_file.tensor(n) for n in self.rank_file.tensor_names()}

    def wait_verified(self) -> None:
        """Raise EngineError if the checksum failed."""
        if self._verification is not None:
            self._verification.result()


def load_engine(
    engine_dir: Path, device: torch.device | None = None, rank: int = 0, verify: bool = True
) -> LoadedEngine:
    """Check config and target, start the checksum check, then map rank `rank`'s file
    (tp > 1: each rank checks its own rank file)."""
    engine_dir = Path(engine_dir)
    cfg = read_engine_config(engine_dir)
    if device is None:
        device = torch.device("cpu" if cfg.target == "cpu" else "cuda")
    check_target(cfg, device)
    if not 0 <= rank < cfg.tp_size:
        raise EngineError(f"rank {rank} is outside the engine's tp_size {cfg.tp_size}", REBUILD)
    name = rank_file_name(rank)
    if not (engine_dir / name).is_file():
        raise EngineError(f"engine rank file {name} is missing", REBUILD)
    future = None
    if verify:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingot-verify")
        future = pool.submit(verify_rank_files, engine_dir, cfg, rank if cfg.tp_size > 1 else None)
        pool.shutdown(wait=False)
    return LoadedEngine(engine_dir, cfg, EngineFile(engine_dir / name), future)
