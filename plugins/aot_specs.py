"""Kernel specs for ahead-of-time compilation: one specialization of one `@triton.jit` kernel as
the JIT sees it at launch (dtypes, pointer alignment, integer classes, constexprs, options), made
by hand (`KernelSpec.of`), recorded from compilations (`record_launches`), and replayed through
Triton's own binder (`_replay`) so a bundle's cache keys are the ones the JIT computes.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_REBUILD = "rebuild with `ingot build-engine --target auto` on this machine"


class AOTBundleError(Exception):
    """A kernel bundle cannot be built, read or used here: what is wrong (message), the fix (hint)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument as specialization sees it: torch dtype name and 16-byte alignment."""

    dtype: str
    aligned: bool = True


class _ArgShape:
    """Stands in for a tensor at specialization: dtype and pointer alignment are all Triton reads."""

    def __init__(self, dtype: Any, aligned: bool) -> None:
        self.dtype = dtype
        self._ptr = 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one `@triton.jit` kernel, as the JIT will see it at launch.

    fn: "package.module:qualname" of the JITFunction. args: one entry per kernel parameter in
    order: a TensorArg for a tensor, else an example value (ints: only the JIT's classes matter — ==1, %16 == 0, i32/i64 range; constexpr
    params: their exact value). options: launch options (num_warps, num_stages, ...).
    """

    fn: str
    args: tuple[Any, ...]
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, fn: Any, *args: Any, **kwargs: Any) -> KernelSpec:
        """The spec of `fn[grid](*args, **kwargs)`; tensors may be real, on `meta`, or `tensor()`."""
        names = fn.arg_names
        options = {k: v for k, v in kwargs.items() if k not in names}
        params = {k: v for k, v in kwargs.items() if k in names}
        bound = inspect.signature(fn.fn).bind(*args, **params)
        bound.apply_defaults()
        return cls(_fn_path(fn), tuple(_describe(bound.arguments[n]) for n in names),
                   tuple(sorted(options.items())))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        args = [{"tensor": a.dtype, "aligned": a.aligned} if isinstance(a, TensorArg) else a
                for a in self.args]  # fmt: skip
        return {"fn": self.fn, "args": args, "options": dict(self.options)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KernelSpec:
        args = tuple(TensorArg(a["tensor"], a["aligned"]) if isinstance(a, dict) else a
                     for a in d["args"])  # fmt: skip
        return cls(d["fn"], args, tuple(sorted(d["options"].items())))


def tensor(dtype: Any, aligned: bool = True) -> TensorArg:
    """A tensor argument for `KernelSpec.of` without allocating one (dtype: torch dtype)."""
    return TensorArg(str(dtype).removeprefix("torch."), aligned)


def _describe(value: Any) -> Any:
    if isinstance(value, TensorArg):
        return value
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return tensor(value.dtype, value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise AOTBundleError(f"kernel argument {value!r} cannot be recorded ahead of time")


def _fn_path(fn: Any) -> str:
    module = fn.fn.__module__
    if module == "__main__" or "<locals>" in fn.fn.__qualname__:
        raise AOTBundleError(
            f"kernel {fn.fn.__qualname__} is not importable by name",
            "define AOT kernels at module level in an importable module",
        )
    return f"{module}:{fn.fn.__qualname__}"


def _import_fn(path: str) -> Any:
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise AOTBundleError(f"engine kernel {path} does not exist in this ingot", _REBUILD) from e
    return obj


def _replay(spec: KernelSpec, backend: Any) -> tuple[Any, Any, Any]:
    """(jit fn, ASTSource, options) exactly as `JITFunction.run` derives them for this launch."""
    import torch
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    fn = _import_fn(spec.fn)
    args = [
        _ArgShape(getattr(torch, a.dtype), a.aligned) if isinstance(a, TensorArg) else a
        for a in spec.args
    ]
    kwargs = dict(spec.options)
    # NOTE: the next two lines mirror JITFunction.run; the rest is Triton's own binder.
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(fn, signature, constexprs, attrs)
    # as triton.compile re-parses what the JIT passes it:
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    return fn, src, options


def _spec_from_source(src: Any, metadata: dict[str, Any]) -> KernelSpec:
    """Invert a compiled ASTSource back into a KernelSpec (checked by replaying it)."""
    fn = src.fn
    args: list[Any] = []
    for i, name in enumerate(fn.arg_names):
        ty = src.signature[name]
        div = ["tt.divisibility", 16] in src.attrs.get((i,), [])
        if ty == "constexpr":
            value = src.constants[(i,)]
            args.append(getattr(value, "value", value))
        elif ty.startswith("*"):
            args.append(TensorArg(_TORCH_DTYPE[ty[1:]], div))
        elif ty in _INT_BASE:
            args.append(_INT_BASE[ty] + (16 if div else 17))
        elif ty == "u1":
            args.append(True)
        elif ty == "fp32":
            args.append(0.5)
        else:
            raise AOTBundleError(f"{_fn_path(fn)}: argument {name} of type {ty} is not supported")
    from triton.compiler import make_backend

    backend = make_backend(metadata["target"])
    defaults = backend.parse_options({}).__dict__
    skip = {"arch", "extern_libs", "instrumentation_mode"}
    options = {k: v for k, v in metadata.items() if k in defaults and k not in skip}
    options = {k: v for k, v in options.items() if _norm(v) != _norm(defaults[k])}
    spec = KernelSpec(_fn_path(fn), tuple(args), tuple(sorted(options.items())))
    if _replay(spec, backend)[1].hash() != src.hash():
        raise AOTBundleError(f"{spec.fn}: cannot reproduce its launch specialization")
    return spec


_INT_BASE = {"i32": 0, "i64": 2**32, "u64": 2**63}
_TORCH_DTYPE = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u1": "bool",
    "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2",
}  # fmt: skip


def _norm(v: Any) -> Any:
    """JSON-comparable form of an option value (tuples -> lists)."""
    return json.loads(json.dumps(v, default=str))


def _options_for_check(options: Any) -> dict[str, Any]:
    d = dict(options.__dict__)
    d["extern_libs"] = [[k, Path(p).name] for k, p in d["extern_libs"]]  # paths differ per machine
    return _norm(d)


@contextlib.contextmanager
def record_launches() -> Iterator[list[KernelSpec]]:
    """Collect a KernelSpec for every Triton kernel compiled or loaded while active.

    The builder wraps its timing / warm-up of the chosen tactics at the engine's shapes in this,
    then passes the (deduplicated) list to `compile_bundle`.
    """
    from triton import knobs

    specs: list[KernelSpec] = []
    previous = knobs.compilation.listener

    def listen(*, src: Any, metadata: dict[str, Any], **kw: Any) -> None:
        if previous is not None:
            previous(src=src, metadata=metadata, **kw)
        if hasattr(src, "fn"):
            spec = _spec_from_source(src, metadata)
            if spec not in specs:
                specs.append(spec)

    knobs.compilation.listener = listen
    try:
        yield specs
    finally:
        knobs.compilation.listener = previous
