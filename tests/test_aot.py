"""AOT kernel bundles: cross-build without a GPU, install, refuse mismatches, launch with no JIT.

CPU tests compile real kernels for sm_90 (Triton needs no GPU for that). GPU tests run each step
in a fresh process (empty in-memory JIT caches, empty Triton cache dir) via `aot_selftest`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (AOT kernels need it)")

from ingot.plugins import aot, aot_selftest  # noqa: E402

NAMES = {"add_kernel", "rms_rows_kernel"}


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The self-test workload cross-built for sm_90 (in a private, empty Triton cache)."""
    with aot.use_cache_dir(tmp_path_factory.mktemp("build-cache")):
        return aot.compile_bundle(aot_selftest.workload_specs(), "sm_90")


def _edit(blob: bytes, **changes: object) -> bytes:
    manifest, payload = aot._unpack(blob)
    return aot._pack({**manifest, **changes}, [bytes(payload)])


def _backend():
    from triton.compiler import make_backend

    return make_backend(aot.parse_target("sm_90"))


# --- CPU: cross-build, manifest, specialization ------------------------------------------------


def test_cross_build_manifest(blob: bytes) -> None:
    m = aot.bundle_manifest(blob)
    assert blob.startswith(aot.MAGIC)
    assert (m["format"], m["triton_version"], m["target"]) == (1, triton.__version__, "sm_90")
    assert {k["name"] for k in m["kernels"]} == NAMES
    add = next(k for k in m["kernels"] if k["name"] == "add_kernel")
    assert add["signature"] == {
        "x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr",
    }  # fmt: skip
    _, payload = aot._unpack(blob)
    for k in m["kernels"]:
        files = {f["file"]: f for f in k["files"]}
        assert set(files) == {f"{k['name']}.cubin", f"{k['name']}.json"}
        cubin = files[f"{k['name']}.cubin"]
        assert bytes(payload[cubin["offset"] : cubin["offset"] + 4]) == b"\x7fELF"
        meta = json.loads(aot._payload(payload, files[f"{k['name']}.json"]))
        assert meta["target"]["arch"] == 90 and meta["triton_version"] == triton.__version__


def test_counter_counts_compiles_not_cache_hits(tmp_path: Path) -> None:
    specs = aot_selftest.workload_specs()
    with aot.use_cache_dir(tmp_path):
        with aot.CompileCounter() as first:
            aot.compile_bundle(specs, "sm_90")
        with aot.CompileCounter() as second:
            aot.compile_bundle(specs, "sm_90")
    assert (first.kernels, first.cache_hits) == (2, 0)
    assert sorted(first.compiled) == sorted(NAMES)
    assert (second.kernels, second.cache_hits) == (0, 2)


def test_one_binary_per_jit_class(tmp_path: Path) -> None:
    """Specs that differ only by int values the JIT puts in one class (17 and 33: neither 1 nor
    a multiple of 16) are one binary: compiled and packed once. 32 is another class."""
    f32 = aot.tensor(torch.float32)
    add = aot_selftest.add_kernel
    specs = [
        aot.KernelSpec.of(add, f32, f32, f32, n, BLOCK=1024, num_warps=4) for n in (17, 33, 32)
    ]
    with aot.use_cache_dir(tmp_path), aot.CompileCounter() as counter:
        blob = aot.compile_bundle(specs, "sm_90")
    kernels = aot.bundle_manifest(blob)["kernels"]
    assert counter.kernels == len(kernels) == 2
    assert [k["spec"]["args"][3] for k in kernels] == [17, 32]


@pytest.mark.skipif(
    shutil.which("gcc") is None or not Path(sysconfig.get_paths()["include"], "Python.h").exists(),
    reason="no C compiler or Python headers",
)
def test_counter_counts_host_builds(tmp_path: Path) -> None:
    from triton.runtime.build import compile_module_from_src

    src = (
        "#include <Python.h>\n"
        'static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "ingot_probe", 0, -1, 0};\n'
        "PyMODINIT_FUNC PyInit_ingot_probe(void) { return PyModule_Create(&m); }\n"
    )
    with aot.use_cache_dir(tmp_path):
        with aot.CompileCounter() as first:
            compile_module_from_src(src, "ingot_probe")
        with aot.CompileCounter() as second:
            compile_module_from_src(src, "ingot_probe")
    assert (first.host_builds, first.host_built, second.host_builds) == (1, ["ingot_probe"], 0)


def test_spec_follows_jit_specialization() -> None:
    f32 = torch.float32
    cases = {
        4096: ("i32", [["tt.divisibility", 16]]),
        4097: ("i32", []),
        2**33: ("i64", [["tt.divisibility", 16]]),
        1: ("constexpr", None),
    }
    for n, (ty, attr) in cases.items():
        x = aot.tensor(f32, aligned=n != 4097)
        spec = aot.KernelSpec.of(aot_selftest.add_kernel, x, x, x, n, BLOCK=256)
        _, src, options = aot._replay(spec, _backend())
        assert src.signature["n"] == ty and src.attrs.get((3,)) == attr
        assert src.attrs[(0,)] == ([] if n == 4097 else [["tt.divisibility", 16]])
        assert options.num_warps == 4 and aot.KernelSpec.from_json(spec.to_json()) == spec
    meta = torch.empty(8, dtype=torch.bfloat16, device="meta")  # meta tensors count as aligned
    spec = aot.KernelSpec.of(aot_selftest.add_kernel, meta, meta, meta, 16, BLOCK=64, num_warps=2)
    assert spec.args[0] == aot.TensorArg("bfloat16", True) and spec.options == (("num_warps", 2),)


def test_record_launches_reproduces_specs(tmp_path: Path) -> None:
    specs = aot_selftest.workload_specs()
    with aot.use_cache_dir(tmp_path), aot.record_launches() as seen:
        aot.compile_bundle(specs, "sm_90")
    be = _backend()
    # NOTE: as sets of (source, options) pairs: compile_bundle compiles side by side, so the
    # listener sees the kernels in the order they finish (the CI run of 08154f0 had them swapped)
    replayed = {(r[1].hash(), r[2].hash()) for r in (aot._replay(s, be) for s in seen)}
    expected = {(e[1].hash(), e[2].hash()) for e in (aot._replay(s, be) for s in specs)}
    assert len(seen) == len(specs) and replayed == expected


# --- CPU: install --------------------------------------------------------------------------------


def _assert_hits(dest: Path) -> None:
    """triton.compile of each spec, as the JIT derives it, finds the installed binary."""
    target = aot.parse_target("sm_90")
    with aot.use_cache_dir(dest), aot.CompileCounter() as c:
        for spec in aot_selftest.workload_specs():
            _, src, options = aot._replay(spec, _backend())
            triton.compile(src, target=target, options=options.__dict__)
    assert (c.kernels, c.cache_hits) == (0, 2)


def test_install_writes_cache_entries(blob: bytes, tmp_path: Path) -> None:
    dest = tmp_path / "kernels"
    report = aot.install_bundle(blob, dest, target="sm_90")
    assert (report.kernels, report.relocated, set(report.names)) == (2, 0, NAMES)
    for name in NAMES:
        (group,) = dest.glob(f"*/__grp__{name}.json")
        children = json.loads(group.read_text())["child_paths"]
        assert set(children) == {f"{name}.cubin", f"{name}.json"}
        assert all(Path(p).parent == group.parent and Path(p).is_file() for p in children.values())
    _assert_hits(dest)


def test_install_relocates_keys_of_another_triton_build(
    blob: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Same Triton version, other build (e.g. the wheel for another Python): another cache key.
    import triton.runtime.cache as cache

    real = cache.triton_key()
    monkeypatch.setattr(cache, "triton_key", lambda: real + "-other-build")
    report = aot.install_bundle(blob, tmp_path, target="sm_90")
    assert report.relocated == 2
    _assert_hits(tmp_path)


# --- CPU: refusals -------------------------------------------------------------------------------


def _refused(blob: bytes, match: str, target: str = "sm_90") -> aot.AOTBundleError:
    with pytest.raises(aot.AOTBundleError, match=match) as info:
        aot.check_bundle(blob, target=target)
    return info.value


def test_refuses_other_triton_version(blob: bytes, tmp_path: Path) -> None:
    old = _edit(blob, triton_version="3.5.0")
    err = _refused(old, "compiled with Triton 3.5.0 for sm_90; this machine has Triton "
                   f"{triton.__version__} on sm_90")  # fmt: skip
    assert "ingot build-engine --target auto" in err.hint
    with pytest.raises(aot.AOTBundleError, match="Triton 3.5.0"):
        aot.install_bundle(old, tmp_path, target="sm_90")
    assert not any(tmp_path.iterdir())  # nothing installed


def test_refuses_other_target(blob: bytes) -> None:
    _refused(blob, "for sm_90; this machine has Triton .* on sm_80", target="sm_80")


def test_refuses_other_ptxas_env_format_and_garbage(blob: bytes) -> None:
    m = aot.bundle_manifest(blob)
    _refused(_edit(blob, ptxas=m["ptxas"].replace("V12", "V11")), "ptxas V11")
    _refused(_edit(blob, env_vars={"TRITON_F32_DEFAULT": "ieee"}), "Triton env")
    _refused(blob[:8] + b"\x09" + blob[9:], "format 9")  # the u32 after the magic
    _refused(b"not a bundle", "not an ingot kernel bundle")


def test_refuses_changed_kernel_source_and_corrupt_files(blob: bytes, tmp_path: Path) -> None:
    m = aot.bundle_manifest(blob)
    kernels = [dict(k, fn_key="0" * 64) if k["name"] == "add_kernel" else k for k in m["kernels"]]
    with pytest.raises(aot.AOTBundleError, match="add_kernel differs from this ingot's source"):
        aot.install_bundle(_edit(blob, kernels=kernels), tmp_path / "a", target="sm_90")
    bad = bytearray(blob)
    bad[-5] ^= 0xFF  # inside the last file's bytes
    with pytest.raises(aot.AOTBundleError, match="is corrupt"):
        aot.install_bundle(bytes(bad), tmp_path / "b", target="sm_90")


_INSTALL_AFTER = """
import sys
from ingot.plugins import aot, pdl
from ingot.plugins.quant import triton_quantize
if sys.argv[2] == "callee_first":
    pdl.pdl_begin.cache_key  # what launching any other PDL-capable kernel first does
aot.install_bundle(open(sys.argv[1], "rb").read(), sys.argv[3], target="sm_90")
"""


def test_source_check_does_not_depend_on_what_the_process_hashed_first(tmp_path: Path) -> None:
    """Triton's own cache_key of `_rms_norm_quant_kernel` differs by whether `pdl_begin` was hashed
    before it; an FP8 engine built on the H200 was refused at load for that. Both orders load."""
    from ingot.plugins.quant import triton_quantize as tq

    bf16 = aot.tensor(torch.bfloat16)
    spec = aot.KernelSpec.of(
        tq._rms_norm_quant_kernel, bf16, bf16, bf16, aot.tensor(torch.float32),
        aot.tensor(torch.float8_e4m3fn), bf16, 4096, 4096, 4096, 4096, 4096, 1e-5,
        HAS_RES=True, BLOCK_D=4096, num_warps=4,
    )  # fmt: skip
    with aot.use_cache_dir(tmp_path / "build-cache"):
        (tmp_path / "bundle").write_bytes(aot.compile_bundle([spec], "sm_90"))
    for order in ("kernel_first", "callee_first"):
        cmd = [sys.executable, "-c", _INSTALL_AFTER, str(tmp_path / "bundle"), order,
               str(tmp_path / order)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{order}: {proc.stderr[-2000:]}"


def test_source_key_covers_called_jit_functions() -> None:
    from ingot.plugins.aot_source import source_key
    from ingot.plugins.quant import triton_quantize as tq

    callee, before = tq.fp8_e4m3_rne, tq.fp8_e4m3_rne.src
    key = source_key(tq._rms_norm_quant_kernel)
    try:
        callee._unsafe_update_src(before.replace("return tl.where", "return 0 + tl.where"))
        assert source_key(tq._rms_norm_quant_kernel) != key
    finally:
        callee._unsafe_update_src(before)
    assert source_key(tq._rms_norm_quant_kernel) == key


def test_bad_target_names() -> None:
    with pytest.raises(aot.AOTBundleError, match="unknown kernel target"):
        aot.parse_target("hopper")
    if not torch.cuda.is_available():
        with pytest.raises(aot.AOTBundleError, match="no CUDA GPU"):
            aot.parse_target("auto")


# --- GPU: launch through the ordinary JIT path with nothing compiled -----------------------------


def _selftest(*argv: str, no_gpu: bool = False) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if no_gpu else None
    cmd = [sys.executable, "-m", "ingot.plugins.aot_selftest", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(argv[0], json.dumps(out))
    return out


def _gpu_target() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major * 10 + minor}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cross_built_bundle_launches_without_compiling(tmp_path: Path) -> None:
    blob_path = tmp_path / "kernels.bin"
    _selftest("cross", str(blob_path), _gpu_target(), no_gpu=True)  # built with the GPU hidden
    out = _selftest("run", str(blob_path), str(tmp_path / "empty-cache"))
    assert out["installed"] == 2 and out["max_err"] < 1e-2
    assert out["seen"]["kernels"] == 0 and out["seen"]["cache_hits"] == 2, out
    # an unbundled specialization (n % 16 != 0) is compiled, and counted: the counter works
    assert out["after_other"] == 1 and out["other_ok"], out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_built_bundle_launches_without_any_compile(tmp_path: Path) -> None:
    blob_path = tmp_path / "kernels.bin"
    built = _selftest("gpu-build", str(blob_path), str(tmp_path / "build-cache"))
    assert len(built["specs"]) == 2
    out = _selftest("run", str(blob_path), str(tmp_path / "empty-cache"))
    assert out["max_err"] < 1e-2 and out["host_stubs"] >= 1
    # kernels and their C launchers both come from the bundle: no compiler runs at all
    assert out["seen"] == {"kernels": 0, "cache_hits": 2, "host_builds": 0, "host_built": []}, out
    assert out["after_other"] == 1, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_refuses_bundle_of_other_triton(blob: bytes) -> None:
    sm = _gpu_target()
    other = _edit(blob, triton_version="3.5.0", target=sm)
    with pytest.raises(aot.AOTBundleError, match=f"Triton 3.5.0 for {sm}; this machine has"):
        aot.check_bundle(other)


def test_refuses_kernels_not_importable_by_name() -> None:
    @triton.jit
    def local_kernel(x_ptr):
        pass

    with pytest.raises(aot.AOTBundleError, match="not importable by name"):
        aot.KernelSpec.of(local_kernel, aot.tensor(torch.float32))
