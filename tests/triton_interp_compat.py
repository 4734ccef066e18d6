"""Test support for Triton's CPU interpreter (TRITON_INTERPRET=1) with NumPy 2.4+.

Triton 3.6's interpreter turns a scalar tensor into a Python int with `int(array)`, which NumPy
2.4 refuses for 1-element arrays that are not 0-d (what the interpreter's scalar loads give).
Importing this module makes the interpreter use `.item()` instead; it changes nothing else and
only matters inside interpreter runs.
"""

from __future__ import annotations

import triton.runtime.interpreter as _interp

_original = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_interp._patch_lang_tensor = _patch_lang_tensor
