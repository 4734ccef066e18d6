"""Plugin registry: a TensorRT-shaped contract per op, keyed by name and version.

A plugin names its typed fields, supported dtypes and tactics, and points (as "module:attr"
strings, imported lazily) at one implementation per target kind: "cpu" is the plain-torch
reference, "cuda" the GPU kernel. An engine records (name, version, tactic) per op; the runtime
resolves them here, so a future TensorRT backend can map the same records onto TensorRT plugins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tactic:
    """One candidate configuration of a kernel (e.g. block sizes, warps); `name` is stable."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dict(self.params)


def joined_tactic(*halves: tuple[str, Tactic | None, str]) -> Tactic:
    """One tactic made of several kernels' tactics (prefix, tactic, label): each one's
    parameters under `prefix`, the names joined by '+' with each label before its name;
    None halves left out (a plugin picks its kernels back by prefix)."""
    kept = [(p, t, label) for p, t, label in halves if t is not None]
    params = tuple((p + k, v) for p, t, _ in kept for k, v in t.params)
    return Tactic("+".join(label + t.name for _, t, label in kept), params)


@dataclass(frozen=True)
class PluginSpec:
    """The contract of one op.

    fields: (name, type) pairs the op takes besides its tensors (e.g. ("eps", "float32")).
    dtypes: activation dtypes the op supports.
    impls: target kind ("cpu", "cuda") -> "module:factory". A factory takes a Tactic (or None)
        and returns the callable the runtime invokes.
    tactics: target kind -> candidate tactics, or "module:ATTR" naming them (imported only when
        asked for, so CPU-only use never imports Triton); the first is the default (used when
        cross-building without a GPU).
    """

    name: str
    version: int
    fields: tuple[tuple[str, str], ...]
    dtypes: tuple[str, ...]
    impls: dict[str, str]
    tactics: dict[str, tuple[Tactic, ...] | str] = field(default_factory=dict)

    def candidates(self, kind: str) -> tuple[Tactic, ...]:
        cands = self.tactics.get(kind, ())
        if isinstance(cands, str):
            cands = tuple(import_attr(cands))
        return cands

    def default_tactic(self, kind: str) -> Tactic | None:
        cands = self.candidates(kind)
        return cands[0] if cands else None

    def find_tactic(self, kind: str, name: str | None) -> Tactic | None:
        if name is None:
            return None
        for t in self.candidates(kind):
            if t.name == name:
                return t
        raise KeyError(f"plugin {self.name} v{self.version} has no {kind} tactic {name!r}")


def import_attr(path: str) -> Any:
    """The object a "package.module:attr" string names (imported on first use)."""
    module_name, attr = path.split(":")
    return getattr(importlib.import_module(module_name), attr)


_REGISTRY: dict[tuple[str, int], PluginSpec] = {}


def register(spec: PluginSpec) -> PluginSpec:
    key = (spec.name, spec.version)
    if key in _REGISTRY and _REGISTRY[key] != spec:
        raise ValueError(
            f"plugin {spec.name} v{spec.version} registered twice with different specs"
        )
    _REGISTRY[key] = spec
    return spec


def get_spec(name: str, version: int | None = None) -> PluginSpec:
    """The spec of `name` at `version` (latest if None). KeyError names what is known."""
    if version is None:
        versions = [v for (n, v) in _REGISTRY if n == name]
        if not versions:
            raise KeyError(f"unknown plugin {name!r}; known: {sorted({n for n, _ in _REGISTRY})}")
        version = max(versions)
    try:
        return _REGISTRY[(name, version)]
    except KeyError:
        raise KeyError(f"plugin {name!r} version {version} is not in this ingot") from None


def all_specs() -> list[PluginSpec]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def target_kind(target: str) -> str:
    """'cpu' -> 'cpu'; 'sm_90' and friends -> 'cuda'."""
    return "cpu" if target == "cpu" else "cuda"


def load(name: str, version: int, kind: str, tactic: Tactic | None = None) -> Callable[..., Any]:
    """Import the implementation lazily and build it for `tactic`."""
    spec = get_spec(name, version)
    if kind not in spec.impls:
        raise KeyError(f"plugin {name} v{version} has no {kind} implementation")
    return import_attr(spec.impls[kind])(tactic)
