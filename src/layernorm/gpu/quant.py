"""The Triton kernels of the norms with their output quantized (docs/derivation.md, "Quantized
output"; :mod:`layernorm.reference.quant` is the oracle). Launched by
:func:`layernorm.gpu.launch.forward_quant`.

Code paths, one line each:

* short rows (D <= launch.MAX_SHORT_D_FWD): ``_quant_short_kernel`` normalizes a tile of whole
  rows as the forward does (:func:`layernorm.gpu.forward._short_rows`) and quantizes y in
  registers: x is read once, q and the scales written once.
* long rows: the long forward writes y in the compute dtype, then ``_quant_rows_kernel``
  reads it twice per row (the groups' scales, then q): one more round trip of y through memory.

The encodings work on the bits, the same on the GPU and in the interpreter: int8 rounds half to
even by adding and subtracting 1.5 2**p (p the significand's stored bits), float8_e4m3fn rounds
the bits to 3 stored significand bits (|v| >= 2**-6) or |v| 2**9 to an integer (below, the
subnormal's code), both after saturating to +-448; the division is correctly rounded (_div).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .elements import INF, _div
from .forward import _short_rows

__all__: list[str] = []


@triton.jit
def _int8_of(v, QMAX: tl.constexpr):
    """v rounded half to even and saturated to [-QMAX, QMAX]; NaN to 0 (as int32)."""
    v = tl.where(v == v, v, 0.0)
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if v.dtype == tl.float64:
        return ((v + 6755399441055744.0) - 6755399441055744.0).to(tl.int32)
    else:
        return ((v + 12582912.0) - 12582912.0).to(tl.int32)


@triton.jit
def _float8_of(v):
    """The float8_e4m3fn code (0 to 255, as int32) of v rounded to nearest even, saturated to
    +-448; NaN to 0x7F."""
    nan = v != v
    v = tl.where(nan, 0.0, v)  # the code is set below; no NaN reaches an integer conversion
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if v.dtype == tl.float64:
        u = v.to(tl.int64, bitcast=True)
        sign = ((u >> 63) & 1).to(tl.int32)
        mag = u & 0x7FFFFFFFFFFFFFFF
        r = mag + ((1 << 48) - 1) + ((mag >> 49) & 1)
        normal = ((r >> 49) - ((1023 - 7) << 3)).to(tl.int32)
        a = mag.to(tl.float64, bitcast=True)
        sub = ((a * 512.0 + 6755399441055744.0) - 6755399441055744.0).to(tl.int32)
    else:
        u = v.to(tl.int32, bitcast=True)
        sign = (u >> 31) & 1
        mag = u & 0x7FFFFFFF
        r = mag + ((1 << 19) - 1) + ((mag >> 20) & 1)
        normal = (r >> 20) - ((127 - 7) << 3)
        a = mag.to(tl.float32, bitcast=True)
        sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return tl.where(nan, 0x7F, code) | (sign << 7)


@triton.jit
def _codes(
    v,  # any shape, y / s in the compute dtype
    finite,  # same shape (broadcast): the scale is finite
    FLOAT8: tl.constexpr,  # float8_e4m3fn codes, else int8
    QMAX: tl.constexpr,  # int8's qmax
):
    """q's codes (int32): the encoding of v, or the fill (0, the float8 NaN) where the scale is
    not finite."""
    if FLOAT8:
        return tl.where(finite, _float8_of(v), 0x7F)
    else:
        return tl.where(finite, _int8_of(v, QMAX), 0)


@triton.jit
def _group_scales(
    y,  # (ROWS, G, GS) y in the compute dtype, 0 outside the row
    ub,  # scale_ub (float32), used when HAS_UB
    QMAX: tl.constexpr,  # the dtype's qmax
    MIN_SCALE: tl.constexpr,  # the dtype's smallest scale
    HAS_UB: tl.constexpr,  # bound max|y| by ub
):
    """(ROWS, G) float32 scales: float32(max(min(amax, ub) / QMAX, MIN_SCALE)), amax NaN where
    the group holds a NaN (the GPU's max passes NaN over), ub applied to a finite amax."""
    a = tl.max(tl.where(y == y, tl.abs(y), 0.0), axis=2)
    nan = tl.max((y != y).to(tl.int32), axis=2) > 0
    # NaN formed here (0 * inf): a NaN constant would fail Triton's check that a global
    # keeps its value from one compilation to the next (NaN is not equal to itself)
    a = tl.where(nan, a * 0.0 * INF, a)
    if HAS_UB:
        a = tl.where(a < INF, tl.minimum(a, ub.to(a.dtype)), a)
    t = _div(a, QMAX)
    return tl.where(t < MIN_SCALE, MIN_SCALE, t).to(tl.float32)


@triton.jit
def _quant_short_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    R,  # *r.dtype (M, D): residual, row stride stride_r; None unless HAS_RESIDUAL
    H,  # *h.dtype (M, D) contiguous: output h = x + r; None unless HAS_RESIDUAL
    Q,  # *int8 or *uint8 (float8 codes) (M, D) contiguous: output
    S,  # *float32 (M, D / G_SIZE): output scales, unless STATIC
    SCALE,  # *float32 (1,): the static scale when STATIC
    UB,  # *float32 (1,): scale_ub when HAS_UB
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    stride_x,  # elements between consecutive rows of X
    stride_r,  # elements between consecutive rows of R
    M,  # number of rows
    D,  # row length
    n_groups,  # scales per row: D / G_SIZE, or 1 per token
    eps: "fp64",  # noqa: F821, UP037 (Triton type string) added to var, unrounded for float64
    CDT: tl.constexpr,  # the compute dtype
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    HAS_RESIDUAL: tl.constexpr,  # add-norm: normalize h = x + r
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FLOAT8: tl.constexpr,  # float8_e4m3fn codes, else int8
    QMAX: tl.constexpr,  # the dtype's qmax
    MIN_SCALE: tl.constexpr,  # the dtype's smallest scale
    STATIC: tl.constexpr,  # one static scale
    HAS_UB: tl.constexpr,  # bound max|y| by scale_ub
    G_SIZE: tl.constexpr,  # channels per scale (BLOCK_D per token)
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    rows64, row_ok, cols, mask, y, _mean, _rstd = _short_rows(
        X, R, H, W, B, stride_x, stride_r, M, D, eps, CDT, CENTRED, HAS_RESIDUAL, WIDE_ADD,
        HAS_W, HAS_B, ZERO_CENTERED, ROWS, BLOCK_D)
    y = tl.where(mask, y, 0.0)  # (ROWS, BLOCK_D)
    G: tl.constexpr = BLOCK_D // G_SIZE
    if STATIC:
        s = tl.load(SCALE).to(CDT)
        v = _div(y, s)
        codes = _codes(v, True, FLOAT8, QMAX)
    else:
        yg = tl.reshape(y, (ROWS, G, G_SIZE))
        sg = _group_scales(yg, tl.load(UB) if HAS_UB else 0.0, QMAX, MIN_SCALE, HAS_UB)
        groups = tl.arange(0, G)  # (G,)
        tl.store(S + rows64[:, None] * n_groups + groups[None, :], sg,
                 mask=row_ok[:, None] & (groups[None, :] < n_groups))
        v = _div(yg, sg.to(CDT)[:, :, None])
        finite = (sg < INF)[:, :, None]
        codes = tl.reshape(_codes(v, finite, FLOAT8, QMAX), (ROWS, BLOCK_D))
    tl.store(Q + rows64[:, None] * D + cols[None, :], codes.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _quant_rows_kernel(
    Y,  # *T (M, D) contiguous: the norm's y in the compute dtype
    Q,  # *int8 or *uint8 (float8 codes) (M, D) contiguous: output
    S,  # *float32 (M, D / G_SIZE): output scales, unless STATIC
    SCALE,  # *float32 (1,): the static scale when STATIC
    UB,  # *float32 (1,): scale_ub when HAS_UB
    D,  # row length
    FLOAT8: tl.constexpr,  # float8_e4m3fn codes, else int8
    QMAX: tl.constexpr,  # the dtype's qmax
    MIN_SCALE: tl.constexpr,  # the dtype's smallest scale
    STATIC: tl.constexpr,  # one static scale
    HAS_UB: tl.constexpr,  # bound max|y| by scale_ub
    PER_TOKEN: tl.constexpr,  # one scale per row, else per group of G_SIZE
    G_SIZE: tl.constexpr,  # channels per scale with per-group scales (divides BLOCK)
    BLOCK: tl.constexpr,  # elements per loop step, a power of two
):
    # One program per row: (dynamic scales) the groups' scales, then q, a block at a time.
    row = tl.program_id(0).to(tl.int64)
    y_row = Y + row * D
    q_row = Q + row * D
    cols = tl.arange(0, BLOCK)
    CDT: tl.constexpr = Y.dtype.element_ty
    if STATIC:
        s_tok = tl.load(SCALE).to(CDT)
    elif PER_TOKEN:  # the row's amax first
        a = tl.zeros((1, 1, BLOCK), CDT)
        nan = tl.zeros((1, 1, BLOCK), tl.int32)
        for start in tl.range(0, D, BLOCK):
            v = tl.load(y_row + start + cols, mask=start + cols < D, other=0.0)
            v = tl.reshape(v, (1, 1, BLOCK))
            a = tl.maximum(a, tl.where(v == v, tl.abs(v), 0.0))
            nan = nan | (v != v).to(tl.int32)
        a = tl.where(nan != 0, a * 0.0 * INF, a)  # (1, 1, BLOCK): NaN where one is
        s_row = _group_scales(a, tl.load(UB) if HAS_UB else 0.0, QMAX, MIN_SCALE, HAS_UB)
        tl.store(S + row + tl.arange(0, 1)[:, None], s_row)
        s_tok = tl.sum(tl.sum(s_row, axis=1), axis=0).to(CDT)  # the one scale (NaN kept)
    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        y = tl.load(y_row + start + cols, mask=ok, other=0.0)
        if STATIC:
            codes = _codes(_div(y, s_tok), True, FLOAT8, QMAX)
        elif PER_TOKEN:
            codes = _codes(_div(y, s_tok), s_tok < INF, FLOAT8, QMAX)
        else:
            G: tl.constexpr = BLOCK // G_SIZE
            yg = tl.reshape(y, (1, G, G_SIZE))
            sg = _group_scales(yg, tl.load(UB) if HAS_UB else 0.0, QMAX, MIN_SCALE, HAS_UB)
            groups = tl.arange(0, G)
            n_groups = D // G_SIZE
            first = start // G_SIZE
            tl.store(S + row * n_groups + first + groups[None, :], sg,
                     mask=first + groups[None, :] < n_groups)
            v = _div(yg, sg.to(CDT)[:, :, None])
            codes = tl.reshape(_codes(v, (sg < INF)[:, :, None], FLOAT8, QMAX), (BLOCK,))
        tl.store(q_row + start + cols, codes.to(Q.dtype.element_ty), mask=ok)
