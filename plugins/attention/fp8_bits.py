"""FP8 (e4m3) cache values widened to fp16 by bit moves instead of the conversion unit.

Why: the decode kernel's loop converts every K and V byte with `F2FP.F16.E4M3.UNPACK_B`, one
instruction per pair; Hopper's conversion unit has a fraction of the ALU's lanes, and the
short-context FP8 decode runs slower with the clock (bound inside the SM, not by memory:
docs/performance.md, 12-06). Moving the 7 bits below the sign down by one into fp16's exponent
and mantissa gives the same value times 2^-8 (fp16's exponent bias is 8 more than e4m3's;
subnormals map to subnormals), with byte permutes, shifts and logic ops on the ALU. The 2^8
joins a scale the kernel applies anyway (the softmax scale for K, the V scale after the loop):
powers of two, so the result is bit for bit the converting kernel's.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..registry import Tactic

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# the factor the widened values are short of: a kernel multiplies the scale it applies by it
FP8_BITS_SCALE = tl.constexpr(256.0)

# 4 bytes (one 32-bit word, byte i = element i) -> 4 fp16 (two words, element 2j low): each
# byte into the high byte of its half (prmt), then the sign kept in place and the other 7 bits
# shifted down by one: (w & 0x8000) | ((w >> 1) & 0x3f80) per half.
_E4M3_TO_F16_SCALED = tl.constexpr("""{
.reg .b32 lo, hi, t;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 t, lo, 1;
and.b32 t, t, 0x3F803F80;
and.b32 lo, lo, 0x80008000;
or.b32 $0, lo, t;
shr.b32 t, hi, 1;
and.b32 t, t, 0x3F803F80;
and.b32 hi, hi, 0x80008000;
or.b32 $1, hi, t;
}""")


@triton.jit
def fp8_to_f16_scaled(x):
    """float8_e4m3fn x as fp16 equal to x * 2^-8, exactly (NaN bytes aside: the pools never
    hold one, FP8 writes saturate)."""
    b = x.to(tl.uint8, bitcast=True)
    if _INTERPRET:  # the same bits by element
        h = ((b & 0x7F).to(tl.uint16) << 7) | ((b & 0x80).to(tl.uint16) << 8)
        return h.to(tl.float16, bitcast=True)
    else:
        return tl.inline_asm_elementwise(
            asm=_E4M3_TO_F16_SCALED,
            constraints="=r,=r,r",
            args=[b],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )


def fp8_bits_tactic(tactic: Tactic, bits: int = 3) -> Tactic:
    """A decode or prefill `tactic` with an FP8 cache's K (bits 1) and/or V (bits 2) widened
    here instead of by the conversion unit: the same output bits, other pipes busy."""
    return Tactic(f"{tactic.name}_b{bits}", (*tactic.params, ("fp8_bits", bits)))
