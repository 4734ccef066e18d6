"""A kernel's source fingerprint for the AOT bundle check, the same in every process.

NOTE: Triton's `JITFunction.cache_key` depends on the order in which a process first hashed its
functions: a callee's constexpr globals join a caller's key only if the callee was hashed before
the caller (Triton 3.6 merges `callee.used_global_vals` before computing the callee's key). A
builder that launched the BF16 norm first (hashing `pdl_begin`, which reads `_INTERPRET`) and a
loader that installs `_rms_norm_quant_kernel` first disagree about an unchanged kernel. So the
bundle records this key instead: the source and first line of the kernel and, recursively, of
every `@triton.jit` function it reaches, with the constexpr globals each reads.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from typing import Any


def source_key(fn: Any) -> str:
    """sha256 over `fn` (a JITFunction) and everything it calls; independent of process history."""
    h = hashlib.sha256()
    _visit(fn, h, set())
    return h.hexdigest()


def _visit(fn: Any, h: Any, seen: set[int]) -> None:
    from triton.runtime.jit import JITCallable

    if id(fn) in seen:
        return
    seen.add(id(fn))
    h.update(f"{fn.__module__}:{fn.__name__}@{fn.starting_line_number}\n{fn.src}\n".encode())
    for name, val in _references(fn):
        if isinstance(val, JITCallable):
            _visit(val, h, seen)
        elif _is_constexpr(val):
            h.update(f"{name}={val.value!r}\n".encode())


def _references(fn: Any) -> list[tuple[str, Any]]:
    """(dotted name, value) of each global or closure name, and attribute chain on one, that the
    kernel's body reads, in source order."""
    scope = {**fn.__globals__, **inspect.getclosurevars(fn.fn).nonlocals}
    out = []
    for node in ast.walk(ast.parse(fn.src)):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain is None or chain[0] not in scope:
                continue
            val = scope[chain[0]]
            for part in chain[1:]:
                val = getattr(val, part, None)
            out.append((".".join(chain), val))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in scope:
            out.append((node.id, scope[node.id]))
    return out


def _chain(node: ast.Attribute) -> list[str] | None:
    parts = [node.attr]
    base: ast.expr = node.value
    while isinstance(base, ast.Attribute):
        parts.append(base.attr)
        base = base.value
    return [base.id, *reversed(parts)] if isinstance(base, ast.Name) else None


def _is_constexpr(val: Any) -> bool:
    from triton.language import constexpr

    return isinstance(val, constexpr)
