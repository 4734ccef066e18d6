"""Two tiny Triton kernels that `tests/test_aot.py` compiles ahead of time and launches.

They exist only to exercise `aot.py` (cross-build, bundle, install, zero-compile launch); the
engine's real kernels live beside their plugins. `python -m ingot.plugins.aot_selftest MODE ...`
runs one step in a fresh process (empty in-memory JIT caches) and prints a JSON line:
  cross BLOB TARGET        compile `workload_specs()` for TARGET (no GPU needed) into BLOB
  gpu-build BLOB CACHE     run the workload on the GPU in CACHE, record and bundle what ran
  run BLOB CACHE           install BLOB into CACHE, run the workload, count compilations
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import triton
import triton.language as tl

from . import aot


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def rms_rows_kernel(x_ptr, w_ptr, out_ptr, D, stride_row, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * rstd * w
    tl.store(out_ptr + row * stride_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """out = x + y through the ordinary JIT launch path. x, y: [N] on the GPU."""
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block, num_warps=num_warps)
    return out


def rms_rows(
    x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, num_warps: int = 4
) -> torch.Tensor:
    """Row-wise RMSNorm: x [R, D] (contiguous), w [D] -> [R, D] in x's dtype."""
    out = torch.empty_like(x)
    rows, d = x.shape
    block_d = triton.next_power_of_2(d)
    rms_rows_kernel[(rows,)](x, w, out, d, x.stride(0), eps, BLOCK_D=block_d, num_warps=num_warps)
    return out


# The "engine shapes" of the self-test workload; `workload_specs` describes the same launches.
N = 4096
ROWS, D = 8, 1000


def workload_specs() -> list[aot.KernelSpec]:
    f32, bf16 = aot.tensor(torch.float32), aot.tensor(torch.bfloat16)
    return [
        aot.KernelSpec.of(add_kernel, f32, f32, f32, N, BLOCK=1024, num_warps=4),
        aot.KernelSpec.of(rms_rows_kernel, bf16, bf16, bf16, D, D, 1e-6, BLOCK_D=1024, num_warps=8),
    ]


def run_workload() -> float:
    """Run both kernels at the workload shapes on the GPU; the worst relative error vs torch."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(N, device="cuda", generator=g) for _ in range(2))
    h = torch.randn(ROWS, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(D, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()
    pairs = [(add(x, y), x + y), (rms_rows(h, w, num_warps=8).float(), ref)]
    return max(((out - r).norm() / r.norm()).item() for out, r in pairs)


def summary(blob: bytes) -> dict[str, object]:
    """What must agree between the building and the running machine, in short."""
    m = aot.bundle_manifest(blob)
    opts = {k["name"]: json.dumps(k["options"], sort_keys=True) for k in m["kernels"]}
    return {
        "python": sys.version.split()[0], "ptxas": aot._short(m["ptxas"]), "env": m["env_vars"],
        "fn_keys": {k["name"]: k["fn_key"][:16] for k in m["kernels"]},
        "options": {n: hashlib.sha256(o.encode()).hexdigest()[:16] for n, o in opts.items()},
    }  # fmt: skip


def main(argv: list[str]) -> dict[str, object]:
    mode, blob_path = argv[0], argv[1]
    if mode == "cross":
        blob = aot.compile_bundle(workload_specs(), argv[2])
        open(blob_path, "wb").write(blob)
        return {"bytes": len(blob), **summary(blob)}
    aot.set_cache_dir(argv[2])  # NOTE: before anything activates Triton's driver
    if mode == "gpu-build":
        with aot.record_launches() as specs:
            run_workload()
        blob = aot.compile_bundle(specs, "auto", host_stubs_from=argv[2])
        open(blob_path, "wb").write(blob)
        return {"bytes": len(blob), "specs": [s.to_json() for s in specs], **summary(blob)}
    with aot.CompileCounter() as c:
        report = aot.install_bundle(open(blob_path, "rb").read(), argv[2])
        err = run_workload()
        seen = {"kernels": c.kernels, "cache_hits": c.cache_hits, "host_builds": c.host_builds}
        seen["host_built"] = list(c.host_built)
        x = torch.ones(N + 1, device="cuda")
        other_ok = bool((add(x, x) == 2).all())  # n % 16 != 0: another specialization
    return {
        "installed": report.kernels, "relocated": report.relocated, "host_stubs": report.host_stubs,
        "max_err": err, "seen": seen, "after_other": c.kernels - seen["kernels"],
        "other_ok": other_ok, "compiled": c.compiled, "fn_key": add_kernel.cache_key,
    }  # fmt: skip


if __name__ == "__main__":
    # NOTE: run the importable module's kernels, not __main__'s copies: a bundle names kernels
    # by module, and `python -m` would make that "__main__".
    from ingot.plugins import aot_selftest

    print(json.dumps(aot_selftest.main(sys.argv[1:])))
