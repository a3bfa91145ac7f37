"""What the Triton kernels of :mod:`layernorm.gpu.forward` and :mod:`layernorm.gpu.backward`
share, element by element: the correctly rounded division and square root, the test for a value
below the normal range, the power-of-two rescaling of a row, the one rounding to a storage dtype,
the add-norms' residual add and the scale; and whether Triton interprets the kernels.
:mod:`layernorm.gpu.kernels` states the maths and the exact facts they rely on.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["INF", "INTERPRET", "NAN"]

INF = tl.constexpr(float("inf"))
NAN = tl.constexpr(float("nan"))


@triton.jit
def _div(a, b):
    """a / b correctly rounded (the GPU's float32 '/' is div.full, within 2 ulps)."""
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _rsqrt(v):
    """1 / sqrt(v), each operation correctly rounded (tl.sqrt is sqrt.approx.ftz on the GPU)."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.div_rn(1.0, tl.sqrt_rn(v))


@triton.jit
def _below_normal(v):
    """v < the smallest normal number of v's dtype: var + eps there has lost bits to underflow."""
    if v.dtype == tl.float64:
        return v < 2.2250738585072014e-308
    else:
        return v < 1.1754943508222875e-38


@triton.jit
def _pow2_scale(a):
    """2**(126 - E) for a float32 a with biased exponent E, so a * s is in [1/2, 1) (float64:
    2**(1022 - E)): an exact scale built from the exponent bits. E is capped (252; 2044) so s
    stays normal: for a >= 2**126 (2**1022) a * s is in [1, 4), still far from overflow; for
    a subnormal a, s = 2**126 (2**1022) and a * s < 1."""
    if a.dtype == tl.float64:
        e = tl.minimum((a.to(tl.int64, bitcast=True) >> 52) & 0x7FF, 2044)
        return ((2045 - e) << 52).to(tl.float64, bitcast=True)
    else:
        e = tl.minimum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 252)
        return ((253 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to(v, dtype: tl.constexpr):
    """v (float32 or float64) rounded once, to nearest even, to ``dtype``.

    On the GPU that is ``v.to(dtype)`` (cvt.rn, float64 to bfloat16 included). Triton's
    interpreter truncates float32 to bfloat16 and garbles float64 to bfloat16, so there the
    rounding is done on the bits: float64 goes to float32 rounded to odd (toward zero, the last
    bit set if inexact, so the second rounding rounds once in effect), then to nearest even.
    """
    if _SOFT_BF16 and dtype == tl.bfloat16:
        if v.dtype == tl.float64:
            f = v.to(tl.float32)
            back = f.to(tl.float64)
            bits = f.to(tl.int32, bitcast=True)
            inexact = back != v
            bits = tl.where(inexact & (tl.abs(back) > tl.abs(v)), bits - 1, bits)
            bits = tl.where(inexact, bits | 1, bits)
        else:
            bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(v != v, (bits >> 16) | 0x40, rounded)  # a NaN stays a NaN, quiet
        return half.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _residual_add(
    x,  # any shape, x's dtype
    r,  # same shape, the residual's dtype
    H_DTYPE: tl.constexpr,  # h's dtype
    WIDE_ADD: tl.constexpr,  # add in float64 (x, r or h is float64), else in float32
):
    """h = x + r in the add's compute dtype, rounded once to h's dtype."""
    if WIDE_ADD:
        return _to(x.to(tl.float64) + r.to(tl.float64), H_DTYPE)
    else:
        return _to(x.to(tl.float32) + r.to(tl.float32), H_DTYPE)


@triton.jit
def _load_scale(
    W,  # *w.dtype (D,): weight
    offs,  # column offsets
    ok,  # valid columns
    CDT: tl.constexpr,  # compute dtype
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
):
    """The scale in the compute dtype: w, or 1 + w formed there (never in a half dtype)."""
    w = tl.load(W + offs, mask=ok, other=0.0).to(CDT)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


INTERPRET: bool = isinstance(_div, InterpretedFunction)
"""True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 at import), on CPU."""

_SOFT_BF16 = tl.constexpr(INTERPRET)  # _to rounds to bfloat16 on the bits (the interpreter)
