"""Ahead-of-time Triton kernels: compile for a target SM, pack into the engine, install at load.

The builder describes each chosen kernel launch as a `KernelSpec` (or records them while it times
tactics on the GPU, `record_launches`), and `compile_bundle` compiles them for the target, with or
without a GPU, into one blob. The runtime calls `install_bundle(blob, dir)` then `set_cache_dir(dir)`
before the first launch; the plugins then launch their `@triton.jit` kernels as usual and Triton
finds every binary in its cache, so nothing is compiled.

NOTE: Triton's cache key hashes its own build (libtriton differs per Python version), the kernel
source, the specialization, the options and ptxas. So a bundle stores each kernel's specialization
and `install_bundle` recomputes the key with the local Triton — the key the JIT computes at launch,
because both come from Triton's own binder (`_replay`). It refuses a bundle whose Triton version,
target, ptxas, compile-affecting env vars, options or kernel source differ from the local ones.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import struct
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import triton

from .aot_source import source_key
from .aot_specs import (  # noqa: F401  (re-exported: the AOT API is used as `aot.X`)
    _REBUILD,
    AOTBundleError,
    KernelSpec,
    TensorArg,
    _options_for_check,
    _replay,
    record_launches,
    tensor,
)
from .compile_threads import map_in_threads

MAGIC = b"INGOTAOT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<IQ")  # format version, manifest length
_KEEP_EXT = (".json", ".cubin")  # all a cache hit needs: metadata and binary
_HOST_STUBS = ("__triton_launcher", "cuda_utils")  # C modules Triton builds with the host compiler


# --- targets -----------------------------------------------------------------------------------


def parse_target(target: str) -> Any:
    """ "sm_90" -> GPUTarget("cuda", 90, 32); "auto" -> the current GPU's (needs a GPU)."""
    from triton.backends.compiler import GPUTarget

    if target == "auto":
        return current_target()
    arch = target.removeprefix("sm_")
    if not target.startswith("sm_") or not arch.isdigit():
        raise AOTBundleError(f"unknown kernel target {target!r}", "use `auto` or e.g. `sm_90`")
    return GPUTarget("cuda", int(arch), 32)


def current_target() -> Any:
    """The GPUTarget of the current CUDA device; AOTBundleError without one."""
    import torch
    from triton.backends.compiler import GPUTarget

    # NOTE: asked of torch, not Triton's driver: activating that builds Triton's C utility module
    # into the cache dir, which must not happen before `install_bundle` has put it there.
    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise AOTBundleError("no CUDA GPU found", "pass an explicit target, e.g. `--target sm_90`")
    major, minor = torch.cuda.get_device_capability()
    return GPUTarget("cuda", major * 10 + minor, 32)


def target_name(target: Any) -> str:
    return f"sm_{target.arch}"


# --- cache dir ---------------------------------------------------------------------------------


def set_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Point Triton's kernel cache at `path` for this process (None: back to Triton's default).

    The runtime calls this with the dir it installed the engine's bundle into, before the first
    launch. Triton mirrors the knob into TRITON_CACHE_DIR, so child processes inherit it.
    """
    from triton import knobs

    knobs.cache.dir = None if path is None else str(path)  # None also clears TRITON_CACHE_DIR
    if path is None:
        del knobs.cache.dir


@contextlib.contextmanager
def use_cache_dir(path: str | os.PathLike[str]) -> Iterator[None]:
    """Triton's kernel cache at `path` inside the block; the previous setting (and env) after."""
    from triton import knobs

    with knobs.cache.scope():
        set_cache_dir(path)
        yield


# --- bundles -----------------------------------------------------------------------------------


def _local_env() -> dict[str, Any]:
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return dict(sorted(get_cache_invalidating_env_vars().items()))


def compile_bundle(
    specs: list[KernelSpec], target: str, host_stubs_from: str | os.PathLike[str] | None = None
) -> bytes:
    """Compile `specs` for `target` ("sm_90" works without a GPU; "auto": this GPU) into a blob.

    Compiles into Triton's current cache dir (cache hits when the build already ran them).
    host_stubs_from: a Triton cache dir in which the kernels were launched on a GPU; the C launcher
    modules Triton built there are packed too, so a runtime with the same Python ABI builds none.
    """
    from triton.compiler import make_backend

    gpu = parse_target(target)
    backend = make_backend(gpu)
    entries, files = [], []
    stub_errors = 0
    unique: dict[tuple[str, str], tuple[KernelSpec, Any, Any, Any]] = {}
    for spec in dict.fromkeys(specs):
        fn, src, options = _replay(spec, backend)
        # NOTE: specs differ by example int values; one binary serves all of a JIT class
        unique.setdefault((src.hash(), options.hash()), (spec, fn, src, options))
    # compiled side by side (plugins/compile_threads.py), packed in the specs' order
    kernels = map_in_threads(
        lambda u: triton.compile(u[2], target=gpu, options=u[3].__dict__), unique.values()
    )
    for (spec, fn, src, options), kernel in zip(unique.values(), kernels, strict=True):
        if host_stubs_from is not None:
            stub_errors += _build_launcher(kernel)
        by_name = {Path(p).name: Path(p) for p in kernel.metadata_group.values()}
        kept = [n for n in sorted(by_name) if n.endswith(_KEEP_EXT)]
        entries.append({
            "name": kernel.name, "fn_key": source_key(fn), "hash": kernel.hash,
            "options": _options_for_check(options), "spec": spec.to_json(),
            "signature": src.signature, "files": [_add(files, by_name[n].read_bytes(), n) for n in kept],
        })  # fmt: skip
    stubs = []
    if host_stubs_from is not None:
        stub_errors += _build_driver_utils()
        for path in sorted(Path(host_stubs_from).glob("*/*.so")):
            if path.name.startswith(_HOST_STUBS):
                stubs.append({"dir": path.parent.name, **_add(files, path.read_bytes(), path.name)})
    manifest = {
        "format": FORMAT_VERSION, "triton_version": triton.__version__, "target": target_name(gpu),
        "ptxas": backend.hash(), "env_vars": _local_env(), "kernels": entries, "host_stubs": stubs,
        "host_abi": sysconfig.get_config_var("EXT_SUFFIX") if stubs else None,
        "host_stub_errors": stub_errors,
    }  # fmt: skip
    return _pack(manifest, files)


def _build_launcher(kernel: Any) -> int:
    """Build `kernel`'s C launcher into the current cache dir (a GPU build), as its first launch
    would: the bundle then ships a launcher for every kernel, not only for those the tactic
    timing happened to launch. Returns 1 when it could not be built (the runtime then builds
    it at the first launch, as without a bundle), else 0."""
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # NOTE: an optimisation only; the engine stays correct without it
        return 1
    return 0


def _build_driver_utils() -> int:
    """Build Triton's driver utility module (`cuda_utils`) into the current cache dir, as the
    first kernel launch of a process does. A process that had launched a kernel before the build
    switched cache dirs (pytest workers did) built it elsewhere, so the bundle lacked it and the
    runtime built it at load. Returns 1 when it could not be built, else 0."""
    try:  # NOTE: the same call and key as CudaUtils.__init__ (triton/backends/nvidia/driver.py)
        from triton.backends.nvidia import driver as nv

        nv.compile_module_from_src(
            src=Path(nv.dirname, "driver.c").read_text(),
            name="cuda_utils",
            library_dirs=nv.library_dirs(),
            include_dirs=nv.include_dirs,
            libraries=nv.libraries,
        )
    except Exception:  # NOTE: an optimisation only, as for the launchers
        return 1
    return 0


def _add(files: list[bytes], data: bytes, name: str) -> dict[str, Any]:
    offset = sum(len(f) for f in files)
    files.append(data)
    return {"file": name, "offset": offset, "size": len(data), "sha256": _sha(data)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pack(manifest: dict[str, Any], files: list[bytes]) -> bytes:
    head = json.dumps(manifest, sort_keys=True).encode()
    return MAGIC + _HEADER.pack(FORMAT_VERSION, len(head)) + head + b"".join(files)


def _unpack(blob: bytes) -> tuple[dict[str, Any], memoryview]:
    n = len(MAGIC) + _HEADER.size
    if len(blob) < n or blob[: len(MAGIC)] != MAGIC:
        raise AOTBundleError("engine kernel bundle is not an ingot kernel bundle", _REBUILD)
    version, size = _HEADER.unpack_from(blob, len(MAGIC))
    if version != FORMAT_VERSION:
        raise AOTBundleError(
            f"engine kernel bundle has format {version}; this ingot reads {FORMAT_VERSION}",
            _REBUILD,
        )
    try:
        manifest = json.loads(bytes(blob[n : n + size]))
    except ValueError as e:
        raise AOTBundleError("engine kernel bundle manifest is corrupt", _REBUILD) from e
    return manifest, memoryview(blob)[n + size :]


def _payload(data: memoryview, entry: dict[str, Any]) -> bytes:
    out = bytes(data[entry["offset"] : entry["offset"] + entry["size"]])
    if len(out) != entry["size"] or _sha(out) != entry["sha256"]:
        raise AOTBundleError(f"engine kernel file {entry['file']} is corrupt", _REBUILD)
    return out


def _short(ptxas_hash: str) -> str:
    """'...Cuda compilation tools, release 12.8, V12.8.93...-90' -> 'V12.8.93'."""
    words = [w for w in ptxas_hash.replace(",", " ").split() if w.startswith("V")]
    return words[-1] if words else ptxas_hash.strip()[:40]


def bundle_manifest(blob: bytes) -> dict[str, Any]:
    """The bundle's manifest: format, triton_version, target, ptxas, env_vars, kernels, ..."""
    return _unpack(blob)[0]


def check_bundle(blob: bytes, target: str | None = None) -> dict[str, Any]:
    """The manifest, if this machine can load the bundle's kernels; else AOTBundleError.

    target: the SM to check against, e.g. "sm_90"; None means the current GPU.
    """
    from triton.compiler import make_backend

    manifest = bundle_manifest(blob)
    gpu = current_target() if target is None else parse_target(target)
    built = f"Triton {manifest['triton_version']} for {manifest['target']}"
    here = f"Triton {triton.__version__} on {target_name(gpu)}"
    if manifest["triton_version"] != triton.__version__ or manifest["target"] != target_name(gpu):
        raise AOTBundleError(
            f"engine kernels were compiled with {built}; this machine has {here}", _REBUILD
        )
    ptxas = make_backend(gpu).hash()
    if manifest["ptxas"] != ptxas:
        raise AOTBundleError(
            f"engine kernels were compiled with ptxas {_short(manifest['ptxas'])}; this machine's "
            f"Triton uses ptxas {_short(ptxas)}",
            "unset TRITON_PTXAS_PATH or " + _REBUILD,
        )
    env = _local_env()
    if manifest["env_vars"] != env:
        raise AOTBundleError(
            f"engine kernels were compiled with Triton env {manifest['env_vars']}; here it is {env}",
            "unset the differing TRITON_* variables or " + _REBUILD,
        )
    return manifest


@dataclass
class InstallReport:
    kernels: int = 0
    relocated: int = 0  # kernels whose cache key differs from the builder's (other Triton build)
    host_stubs: int = 0
    names: list[str] = field(default_factory=list)


def install_bundle(
    blob: bytes, dest_dir: str | os.PathLike[str], target: str | None = None
) -> InstallReport:
    """Write the bundle's kernels into `dest_dir` as Triton cache entries under the keys the local
    JIT will compute, after `check_bundle`. Then `set_cache_dir(dest_dir)` before the first launch.

    Imports each kernel's module. Raises AOTBundleError when a kernel's source differs from the
    one compiled (the engine came from another ingot) or its options would differ here.
    """
    from triton.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    manifest = check_bundle(blob, target)
    _, data = _unpack(blob)
    backend = make_backend(parse_target(manifest["target"]))
    report = InstallReport()
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    with use_cache_dir(dest_dir):
        for entry in manifest["kernels"]:
            spec = KernelSpec.from_json(entry["spec"])
            fn, src, options = _replay(spec, backend)
            if source_key(fn) != entry["fn_key"]:
                raise AOTBundleError(
                    f"engine kernel {spec.fn} differs from this ingot's source", _REBUILD
                )
            if _options_for_check(options) != entry["options"]:
                raise AOTBundleError(
                    f"engine kernel {spec.fn} compile options differ here", _REBUILD
                )
            key = get_cache_key(src, backend, options, _local_env())
            digest = hashlib.sha256(key.encode()).hexdigest()
            cache = get_cache_manager(digest)
            group = {}
            for f in entry["files"]:
                content = _payload(data, f)
                if f["file"].endswith(".json"):
                    meta = json.loads(content)
                    meta["hash"] = digest  # NOTE: CompiledKernel takes the hash from its key
                    content = json.dumps(meta).encode()
                group[f["file"]] = cache.put(content, f["file"], binary=True)
            cache.put_group(f"{entry['name']}.json", group)
            report.kernels += 1
            report.relocated += digest != entry["hash"]
            report.names.append(entry["name"])
        if manifest["host_abi"] == sysconfig.get_config_var("EXT_SUFFIX"):
            for stub in manifest["host_stubs"]:
                digest = base64.b32decode(stub["dir"] + "=" * (-len(stub["dir"]) % 8)).hex()
                get_cache_manager(digest).put(_payload(data, stub), stub["file"], binary=True)
                report.host_stubs += 1
    return report


# --- counting compilations ---------------------------------------------------------------------


class CompileCounter:
    """Counts what Triton compiles while active.

    kernels: Triton pipeline runs (source -> cubin); a cache hit is not one (`cache_hits`).
    host_builds: C modules (kernel launchers, driver utils) built with the host C compiler.
    Uses `triton.knobs.compilation.listener` (called by `triton.compile` with cache_hit) and wraps
    `triton.runtime.build._build`, which `compile_module_from_src` calls only on a cache miss.
    """

    def __init__(self) -> None:
        self.kernels = 0
        self.cache_hits = 0
        self.host_builds = 0
        self.compiled: list[str] = []
        self.host_built: list[str] = []

    def __enter__(self) -> CompileCounter:
        import triton.runtime.build as build
        from triton import knobs

        self._previous = knobs.compilation.listener
        self._build = build._build
        knobs.compilation.listener = self._listen
        build._build = self._count_build
        return self

    def __exit__(self, *exc: object) -> None:
        import triton.runtime.build as build
        from triton import knobs

        knobs.compilation.listener = self._previous
        build._build = self._build

    def _listen(self, *, src: Any, metadata: dict[str, Any], cache_hit: bool, **kw: Any) -> None:
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, cache_hit=cache_hit, **kw)
        if cache_hit:
            self.cache_hits += 1
        else:
            self.kernels += 1
            self.compiled.append(str(metadata.get("name", getattr(src, "name", "?"))))

    def _count_build(self, name: str, *args: Any, **kwargs: Any) -> str:
        self.host_builds += 1
        self.host_built.append(name)
        return self._build(name, *args, **kwargs)
