r"""Fused Triton kernels for the family of norms; their launchers, which pick a plan per row
length, check the arguments and allocate the outputs, are :mod:`layernorm.gpu.launch`.

The maths, for one row of length D (the NumPy oracle, :mod:`layernorm.reference`, computes the
same; docs/gpu-fusion.md explains the design). T is the compute dtype: float64 for float64 data,
float32 otherwise. LayerNorm (``centred``) and RMSNorm share every kernel:

    [add]  h_j = x_j + r_j in the widest compute dtype of x, r and h, rounded once to h's dtype;
           the row normalized below (xn) is h as rounded, else xn = x
    LayerNorm                                  RMSNorm
    m    = (1/D) sum_j xn_j                    (no mean: MEAN = 0)
    c    = (1/D) sum_j (xn_j - m)              the rounding error of m
    xc_j = (xn_j - m) - c                      xc_j = xn_j
    var  = (1/D) sum_j xc_j^2                  var = (1/D) sum_j xn_j^2
    MEAN = m + c,  RSTD = 1 / sqrt(var + eps),  xhat_j = xc_j * RSTD
    y_j  = scale_j * xhat_j + beta_j           scale = w, or 1 + w (zero_centered_gamma) in T

    g_j  = dy_j * scale_j                      (g = dy without weight)
    dn_j = RSTD * (g_j - mean(g) - xhat_j * mean(g * xhat))     [RMSNorm: no mean(g)]
    dx_j = dn_j;  add-norms: dx_j = dresidual_j = dn_j + dh_j in the add's dtype, rounded once
           to x's dtype and once to the residual's
    dw_j = sum over rows of dy_j * xhat_j,  db_j = sum over rows of dy_j

Exact facts the kernels rely on, whatever the hardware's division and square root:

1. A constant row (LayerNorm: max == min; RMSNorm: every element 0) is found by comparison,
   not by var == 0: xhat = 0 exactly, y = beta (0 for RMSNorm), MEAN = the row's value,
   RSTD = 1/sqrt(eps) (inf when eps = 0; the backward's dx on such a row is then rstd times
   g - mean(g): +-inf, or NaN where that is 0, as the derivative there is unbounded).
2. Row reductions' divisions and the square root are correctly rounded (tl.div_rn,
   tl.sqrt_rn; float64 '/' and sqrt are already), so the GPU computes what the interpreter
   shows, and RSTD is not flushed to zero.
3. A row whose sums overflow T, or whose var + eps falls below T's smallest normal number
   (eps = 0 and tiny values), is recomputed as xn * s, s = 2**k from max|xn| (exact), with
   eps * s**2. It saves the statistics of xn * s, RSTD negated as the mark: MEAN = mean(xn * s),
   RSTD = -1/sqrt(var(xn * s) + eps * s**2). The backward recomputes s from max|xn| and works
   on xn * s, so no value of the row overflows there either; dx = s * (RSTD_s * bracket).

Code paths, one line each:

* short rows (D <= launch.MAX_SHORT_D_FWD forward, MAX_SHORT_D_BWD backward): a program holds
  a tile of whole rows (several rows when D is small) in registers; x (and dy) are read once.
* long rows: a program loops over its row in blocks of launch.LONG_BLOCK; the forward reads xn
  twice (statistics with a Chan merge of block statistics, then y); add-norms write h in the
  first pass and read it back in the second. The backward is a row-statistics kernel (three row
  means per row, and s) and a dx kernel on a (row chunk, column block) grid.
* the rescaled rows of item 3: a branch per tile (or row) taken only where a row needs it.
* float64 data: the same kernels in float64, with tiles half as large (``launch.plan(wide=True)``).
* the memory-efficient backward (:func:`launch.backward_from_y`): the same backward kernels with
  FROM_Y, reading y where they read xn: xhat_j = (y_j - shift_j) / scale_j (shift = bias,
  a correctly rounded division), or, on the k channels layernorm.recovery keeps, the saved
  xhat from an (M, k) store through a per-channel map (channel -> column, -1 if recovered);
  on the r rows layernorm.recovery keeps whole (var < eps under a shift), the saved xhat on
  every channel from an (r, D) store through a per-row map (row -> its row there, -1 if
  recovered), read once per row (a branch per tile or row, compiled only when r > 0).
  No mean, no correction pass, no rescaling: rstd is the row's own.
* dw and db: each backward program adds its rows into partial sums in T, one (P, D) row per
  program; a second kernel sums the P rows in a fixed order. No atomics: bit-identical runs.

Results are rounded once to their dtype (y to x's; h to h's; dx, dresidual, dw, db to their
own). A row's y and dx do not depend on the other rows, nor on M.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["INTERPRET"]

INF = tl.constexpr(float("inf"))
NAN = tl.constexpr(float("nan"))


# ---------------------------------------------------------------------------------------------
# Element helpers
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _moments(
    x,  # (ROWS, BLOCK_D) compute dtype, zero where not mask
    mask,  # (ROWS, BLOCK_D) valid entries
    n,  # D in the compute dtype
    CENTRED: tl.constexpr,  # LayerNorm: centre the rows
):
    """(ROWS,) mean, (ROWS, BLOCK_D) centred values, (ROWS,) var; uncentred (RMSNorm): 0, x
    and mean(x**2).

    The mean returned is m + c, the first-pass mean plus the mean of the centred values (its
    rounding error), which the correction removes from every centred value.
    """
    if CENTRED:
        m = _div(tl.sum(x, axis=1), n)  # (ROWS,)
        xc = tl.where(mask, x - m[:, None], 0.0)  # (ROWS, BLOCK_D)
        c = _div(tl.sum(xc, axis=1), n)  # (ROWS,) the rounding error of m
        xc = tl.where(mask, xc - c[:, None], 0.0)  # (ROWS, BLOCK_D)
        return m + c, xc, _div(tl.sum(xc * xc, axis=1), n)
    else:
        return tl.zeros((x.shape[0],), x.dtype), x, _div(tl.sum(x * x, axis=1), n)


@triton.jit
def _fwd_short_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    R,  # *r.dtype (M, D): residual, row stride stride_r; None unless HAS_RESIDUAL
    H,  # *h.dtype (M, D) contiguous: output h = x + r; None unless HAS_RESIDUAL
    Y,  # *x.dtype (M, D) contiguous: output
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    MEAN,  # *T (M,): output, MEAN (0 for RMSNorm); T, the compute dtype, is MEAN's dtype
    RSTD,  # *T (M,): output, RSTD (negated on rescaled rows)
    stride_x,  # elements between consecutive rows of X
    stride_r,  # elements between consecutive rows of R
    M,  # number of rows
    D,  # row length
    eps: "fp64",  # noqa: F821, UP037 (Triton type string) added to var, unrounded for float64
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    HAS_RESIDUAL: tl.constexpr,  # add-norm: normalize h = x + r
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    CDT: tl.constexpr = MEAN.dtype.element_ty
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_ok = rows < M  # (ROWS,)
    col_ok = cols < D  # (BLOCK_D,)
    mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_D)
    rows64 = rows.to(tl.int64)  # offsets of large tensors overflow int32
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = _residual_add(x, r, H.dtype.element_ty, WIDE_ADD)  # (ROWS, BLOCK_D) rounded once
        tl.store(H + rows64[:, None] * D + cols[None, :], h, mask=mask)
        xn = h.to(CDT)  # (ROWS, BLOCK_D) the norm reads h as rounded
    else:
        xn = x.to(CDT)  # (ROWS, BLOCK_D)
    eps_t = (tl.zeros([], tl.float64) + eps).to(CDT)
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)

    mean, xc, var = _moments(xn, mask, n, CENTRED)  # (ROWS,), (ROWS, BLOCK_D), (ROWS,)
    # Exact facts of each row: its largest magnitude, and whether it is constant. A NaN counts
    # as +inf in the maximum (the GPU's max ignores NaN, the interpreter's propagates it).
    if CENTRED:
        top = tl.max(tl.where(mask, tl.where(xn == xn, xn, INF), -INF), axis=1)  # (ROWS,)
        bot = tl.min(tl.where(mask, xn, INF), axis=1)  # (ROWS,)
        const = (top == bot) & (tl.abs(top) < INF)
        big = tl.maximum(tl.abs(top), tl.abs(bot))  # (ROWS,) max|xn|
    else:
        big = tl.max(tl.where(xn == xn, tl.abs(xn), INF), axis=1)  # (ROWS,) max|xn|
        const = big == 0.0
    scaled = row_ok & ~const & (~(var < INF) | _below_normal(var + eps_t))  # (ROWS,)
    s = tl.full((ROWS,), 1.0, CDT)  # the rows are xn * s
    eps_s = tl.zeros((ROWS,), CDT) + eps_t  # eps * s**2
    if tl.sum(scaled.to(tl.int32), axis=0) > 0:  # rare: recompute those rows as xn * s
        s = tl.where(scaled, _pow2_scale(big), 1.0)
        mean_s, xc_s, var_s = _moments(xn * s[:, None], mask, n, CENTRED)
        mean = tl.where(scaled, mean_s, mean)
        xc = tl.where(scaled[:, None], xc_s, xc)
        var = tl.where(scaled, var_s, var)
        eps_s = tl.where(scaled, eps_t * s * s, eps_s)
    rstd = _rsqrt(var + eps_s)  # (ROWS,)
    y = tl.where(const[:, None], 0.0, xc * rstd[:, None])  # (ROWS, BLOCK_D) xhat
    if HAS_W:
        y = y * _load_scale(W, cols, col_ok, CDT, ZERO_CENTERED)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(CDT)[None, :]
    tl.store(Y + rows64[:, None] * D + cols[None, :], _to(y, Y.dtype.element_ty), mask=mask)
    if CENTRED:
        mean = tl.where(const, top, mean)  # the row's value, exactly
    tl.store(MEAN + rows, mean, mask=row_ok)
    rstd = tl.where(scaled, -rstd, rstd)
    tl.store(RSTD + rows, tl.where(const, _rsqrt(eps_t), rstd), mask=row_ok)


@triton.jit
def _load_xn(
    x_ptrs,  # pointers into the row of x (of h when not HAS_RESIDUAL and reading it back)
    r_ptrs,  # pointers into the row of the residual
    h_ptrs,  # pointers into the row of h, written here when HAS_RESIDUAL
    ok,  # valid entries
    CDT: tl.constexpr,  # compute dtype
    HAS_RESIDUAL: tl.constexpr,  # form h = x + r, store it, return it
    WIDE_ADD: tl.constexpr,  # the add computes in float64
):
    """A block of the normalized row in the compute dtype: x, or h = x + r (stored)."""
    x = tl.load(x_ptrs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        h = _residual_add(x, tl.load(r_ptrs, mask=ok, other=0.0), h_ptrs.dtype.element_ty,
                          WIDE_ADD)
        tl.store(h_ptrs, h, mask=ok)
        return h.to(CDT)
    else:
        return x.to(CDT)


@triton.jit
def _block_stats(
    d,  # (BLOCK,) values of one block, zero where not ok
    ok,  # (BLOCK,) valid entries
    n,  # number of valid entries, compute dtype
):
    """Mean and sum of squared deviations of one block, the reference's way: first-pass mean,
    then the correction pass."""
    m = _div(tl.sum(d, axis=0), n)
    e = tl.where(ok, d - m, 0.0)
    c = _div(tl.sum(e, axis=0), n)
    e = tl.where(ok, e - c, 0.0)
    return m + c, tl.sum(e * e, axis=0)


@triton.jit
def _long_row_stats(
    x_row,  # *: start of the row of x (of h, when reading h back)
    r_row,  # *: start of the row of the residual (HAS_RESIDUAL)
    h_row,  # *: start of the row of h, written here (HAS_RESIDUAL)
    D,  # row length
    scale,  # power of two: statistics of xn * scale
    CDT: tl.constexpr,  # compute dtype
    CENTRED: tl.constexpr,  # LayerNorm statistics, else the sum of squares
    HAS_RESIDUAL: tl.constexpr,  # form and store h on the way
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    BLOCK: tl.constexpr,  # elements per loop step
):
    """One pass over a long row xn: (shift, mean, m2, top, bot).

    LayerNorm: mean and m2 (sum of squared deviations) of xn * scale - shift, shift the mean of
    block 0 (so the running mean stays small, and its rounding error); each block gets the
    corrected two-pass treatment and blocks merge with Chan's formula
        n = na + nb,  delta = mean_b - mean_a,
        mean = mean_a + delta * nb / n,  M2 = M2_a + M2_b + delta^2 * na * nb / n.
    RMSNorm: shift = mean = 0, m2 = sum of (xn * scale)^2 (blocked).
    top and bot: max and min of xn (NaN as +inf in the max); RMSNorm: top = max|xn|.
    """
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    ok = cols < D
    xn = _load_xn(x_row + cols, r_row + cols, h_row + cols, ok, CDT, HAS_RESIDUAL, WIDE_ADD)
    if CENTRED:
        top = tl.where(ok, tl.where(xn == xn, xn, INF), -INF)  # (BLOCK,) running max
        bot = tl.where(ok, xn, INF)  # (BLOCK,) running min
        xs = xn * scale
        n = tl.minimum(D, BLOCK).to(CDT)
        shift = _div(tl.sum(xs, axis=0), n)
        mean, m2 = _block_stats(tl.where(ok, xs - shift, 0.0), ok, n)
    else:
        top = tl.where(xn == xn, tl.abs(xn), INF)  # (BLOCK,) running max|xn|
        bot = top
        sq = (xn * scale) * (xn * scale)  # (BLOCK,) blocked sum of squares
    for start in tl.range(BLOCK, D, BLOCK):
        ok = start + cols < D
        xn = _load_xn(x_row + start + cols, r_row + start + cols, h_row + start + cols, ok, CDT,
                      HAS_RESIDUAL, WIDE_ADD)
        if CENTRED:
            top = tl.maximum(top, tl.where(ok, tl.where(xn == xn, xn, INF), -INF))
            bot = tl.minimum(bot, tl.where(ok, xn, INF))
            nb = tl.minimum(D - start, BLOCK).to(CDT)
            mean_b, m2_b = _block_stats(tl.where(ok, xn * scale - shift, 0.0), ok, nb)
            n_new = n + nb
            delta = mean_b - mean
            mean += delta * _div(nb, n_new)
            m2 += m2_b + delta * delta * (_div(n, n_new) * nb)
            n = n_new
        else:
            top = tl.maximum(top, tl.where(xn == xn, tl.abs(xn), INF))
            sq += (xn * scale) * (xn * scale)
    if CENTRED:
        return shift, mean, m2, tl.max(top, axis=0), tl.min(bot, axis=0)
    else:
        zero = tl.zeros([], CDT)
        big = tl.max(top, axis=0)
        return zero, zero, tl.sum(sq, axis=0), big, big


@triton.jit
def _fwd_long_kernel(
    X,  # *x.dtype (M, D): input rows, row stride stride_x, unit column stride
    R,  # *r.dtype (M, D): residual, row stride stride_r; None unless HAS_RESIDUAL
    H,  # *h.dtype (M, D) contiguous: output h = x + r; None unless HAS_RESIDUAL
    Y,  # *x.dtype (M, D) contiguous: output
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, or None when HAS_B is False
    MEAN,  # *T (M,): output, MEAN (0 for RMSNorm); T, the compute dtype, is MEAN's dtype
    RSTD,  # *T (M,): output, RSTD (negated on rescaled rows)
    stride_x,  # elements between consecutive rows of X
    stride_r,  # elements between consecutive rows of R
    D,  # row length
    eps: "fp64",  # noqa: F821, UP037 (Triton type string) added to var, unrounded for float64
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    HAS_RESIDUAL: tl.constexpr,  # add-norm: normalize h = x + r
    WIDE_ADD: tl.constexpr,  # the add computes in float64
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # bias present
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    BLOCK: tl.constexpr,  # elements per loop step
):
    # One program per row: one pass for the statistics (forming and storing h for add-norms),
    # one to normalize (reading h back).
    CDT: tl.constexpr = MEAN.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    if HAS_RESIDUAL:
        r_row = R + row * stride_r
        h_row = H + row * D
        xn_row = h_row
    else:
        r_row = x_row
        h_row = x_row
        xn_row = x_row
    y_row = Y + row * D
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    eps_t = (tl.zeros([], tl.float64) + eps).to(CDT)
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)

    s = tl.full([], 1.0, CDT)  # the row is xn * s
    shift, mean, m2, top, bot = _long_row_stats(x_row, r_row, h_row, D, s, CDT, CENTRED,
                                                HAS_RESIDUAL, WIDE_ADD, BLOCK)
    var = _div(m2, n)
    if CENTRED:
        const = (top == bot) & (tl.abs(top) < INF)
        big = tl.maximum(tl.abs(top), tl.abs(bot))  # max|xn|
    else:
        const = top == 0.0
        big = top
    scaled = ~const & (~(var < INF) | _below_normal(var + eps_t))
    eps_s = eps_t  # eps * s**2
    if scaled:  # rare: one more pass, on xn * s
        if HAS_RESIDUAL:
            tl.debug_barrier()  # h, stored by every thread, is read back
        s = _pow2_scale(big)
        shift, mean, m2, _, _ = _long_row_stats(xn_row, xn_row, xn_row, D, s, CDT, CENTRED,
                                                False, WIDE_ADD, BLOCK)
        var = _div(m2, n)
        eps_s = eps_t * s * s
    rstd = _rsqrt(var + eps_s)
    # The mean is shift + mean. Rounded it is hi; lo is what the rounding lost (shift - hi is
    # exact when the two are within a factor of two, when it matters). A constant row's mean
    # is its value, exactly, so its centred values are exactly 0.
    hi = shift + mean
    lo = (shift - hi) + mean
    if CENTRED:
        hi = tl.where(const, top, hi)
        lo = tl.where(const, 0.0, lo)
    tl.store(MEAN + row, hi)
    tl.store(RSTD + row, tl.where(const, _rsqrt(eps_t), tl.where(scaled, -rstd, rstd)))
    rstd = tl.where(const, 0.0, rstd)  # xhat = 0 on a constant row (and never 0 * inf)

    if HAS_RESIDUAL:
        tl.debug_barrier()  # h, stored by every thread, is read back
    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        xn = tl.load(xn_row + start + cols, mask=ok, other=0.0).to(CDT) * s
        if CENTRED:
            y = ((xn - hi) - lo) * rstd  # (BLOCK,) xhat
        else:
            y = xn * rstd  # (BLOCK,) xhat
        if HAS_W:
            y = y * _load_scale(W, start + cols, ok, CDT, ZERO_CENTERED)
        if HAS_B:
            y = y + tl.load(B + start + cols, mask=ok, other=0.0).to(CDT)
        tl.store(y_row + start + cols, _to(y, Y.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_dx(
    dn,  # dnorm, the norm's gradient w.r.t. xn, in the compute dtype
    dh,  # dh (loaded, its own dtype), ignored unless HAS_DH
    DX,  # *dx.dtype: gradient of x
    DR,  # *dr.dtype: gradient of the residual; None unless IS_ADD
    offs,  # offsets of dn's elements in DX and DR
    mask,  # valid entries
    IS_ADD: tl.constexpr,  # add-norm: dx = dresidual = dn + dh
    HAS_DH: tl.constexpr,  # dh present
    WIDE_ADD: tl.constexpr,  # the add's compute dtype is float64
):
    """Store dx (and dresidual): dn rounded once, or dn + dh formed in the add's compute dtype
    and rounded once to each output's dtype."""
    if IS_ADD:
        if WIDE_ADD:
            t = dn.to(tl.float64)
            if HAS_DH:
                t = t + dh.to(tl.float64)
        else:
            t = dn.to(tl.float32)
            if HAS_DH:
                t = t + dh.to(tl.float32)
        tl.store(DX + offs, _to(t, DX.dtype.element_ty), mask=mask)
        tl.store(DR + offs, _to(t, DR.dtype.element_ty), mask=mask)
    else:
        tl.store(DX + offs, _to(dn, DX.dtype.element_ty), mask=mask)


@triton.jit
def _from_y_params(
    B,  # *b.dtype (D,): bias; None unless HAS_B
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 where recovered; None unless HAS_KEPT
    offs,  # channels
    ok,  # valid channels
    CDT: tl.constexpr,  # compute dtype
    HAS_B: tl.constexpr,  # bias present
    HAS_KEPT: tl.constexpr,  # some channels are kept
):
    """The recovery's values at ``offs``: the shift in the compute dtype (0 without bias) and
    each channel's column in KEPT (-1: recovered from y)."""
    shift = tl.zeros(offs.shape, CDT)
    if HAS_B:
        shift = tl.load(B + offs, mask=ok, other=0.0).to(CDT)
    kcol = tl.full(offs.shape, -1, tl.int32)
    if HAS_KEPT:
        kcol = tl.load(KMAP + offs, mask=ok, other=-1)
    return shift, kcol


@triton.jit
def _xhat_from_y(
    y,  # y in the compute dtype, any shape
    shift,  # the shift (bias) in the compute dtype, broadcast to y; ignored unless HAS_B
    scale,  # the scale in the compute dtype, broadcast to y; ignored unless HAS_W
    kcol,  # int32, broadcast to y: column of each channel in KEPT, -1 where recovered
    KEPT,  # *T: xhat of the kept channels; None unless HAS_KEPT
    kept_offs,  # offsets of the rows' starts in KEPT, broadcast to y
    ok,  # valid entries
    HAS_W: tl.constexpr,  # divide by the scale
    HAS_B: tl.constexpr,  # subtract the shift
    HAS_KEPT: tl.constexpr,  # some channels are kept
):
    """xhat recovered from y: (y - shift) / scale, each operation correctly rounded (a
    division, not a reciprocal's product), the kept channels' xhat read from KEPT instead;
    0 where not ok."""
    xhat = y
    if HAS_B:
        xhat = xhat - shift
    if HAS_W:
        xhat = _div(xhat, scale)
    if HAS_KEPT:
        is_kept = kcol >= 0
        kept = tl.load(KEPT + kept_offs + kcol, mask=ok & is_kept, other=0.0)
        xhat = tl.where(is_kept, kept, xhat)  # never a blend: a zero scale gives inf or NaN
    return tl.where(ok, xhat, 0.0)


@triton.jit
def _whole_rows(
    xhat,  # (ROWS, BLOCK_D) xhat recovered from y (_xhat_from_y)
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows
    ridx,  # (ROWS, 1) int32: each row's row in XROWS, -1 where recovered
    stride_rows,  # elements between consecutive rows of XROWS
    offs,  # (1, BLOCK_D) channels
    ok,  # (ROWS, BLOCK_D) valid entries
):
    """xhat with the rows kept whole read from XROWS on every channel (their y is not used:
    recovery through the shift would lose their relative accuracy); 0 where not ok."""
    whole = ridx >= 0
    stored = tl.load(XROWS + tl.maximum(ridx, 0).to(tl.int64) * stride_rows + offs,
                     mask=ok & whole, other=0.0)
    return tl.where(whole, stored, xhat)


@triton.jit
def _bwd_short_kernel(
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    DH,  # *dh.dtype (M, D): gradient of h, row stride stride_dh; None unless HAS_DH
    XN,  # *xn.dtype (M, D): what the forward normalized (x, or h), row stride stride_xn;
    #      y (x's dtype) when FROM_Y
    DX,  # *dx.dtype (M, D) contiguous: output, gradient of x
    DR,  # *dr.dtype (M, D) contiguous: output, gradient of the residual; None unless IS_ADD
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, the shift y is recovered with; None unless FROM_Y and HAS_B
    MEAN,  # *T (M,): the forward's MEAN; None when FROM_Y
    RSTD,  # *T (M,): the forward's RSTD (negative: a rescaled row); T, the compute dtype, is
    #        RSTD's dtype. FROM_Y: the row's 1 / sqrt(var + eps), never negative
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 if recovered; None unless HAS_KEPT
    KEPT,  # *T (M, k): xhat of the kept channels, row stride stride_kept; None unless HAS_KEPT
    ROWMAP,  # *int32 (M,): row of each row in XROWS, -1 if recovered; None unless HAS_ROWS
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows; None unless HAS_ROWS
    DW_PART,  # *T (P, D): output, row p = this program's sum of dy * xhat
    DB_PART,  # *T (P, D): output, row p = this program's sum of dy
    stride_dy,  # elements between consecutive rows of DY
    stride_dh,  # elements between consecutive rows of DH
    stride_xn,  # elements between consecutive rows of XN
    stride_kept,  # elements between consecutive rows of KEPT
    stride_rows,  # elements between consecutive rows of XROWS
    M,  # number of rows
    D,  # row length
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    IS_ADD: tl.constexpr,  # add-norm: write dx and dresidual
    HAS_DH: tl.constexpr,  # dh present
    WIDE_ADD: tl.constexpr,  # the add's compute dtype is float64
    HAS_W: tl.constexpr,  # weight present: compute dw partial sums
    HAS_B: tl.constexpr,  # bias present: compute db partial sums (and, FROM_Y, shift by it)
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FROM_Y: tl.constexpr,  # XN is y: xhat = (y - shift) / scale, or KEPT on kept channels,
    #                        or XROWS on rows kept whole
    HAS_KEPT: tl.constexpr,  # FROM_Y with k > 0 kept channels
    HAS_ROWS: tl.constexpr,  # FROM_Y with r > 0 rows kept whole
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per tile row
):
    # Persistent: P programs; program p owns row tiles p, p + P, p + 2P, ... and keeps its share
    # of dw and db in registers until the end.
    CDT: tl.constexpr = RSTD.dtype.element_ty
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    col_ok = cols < D
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)
    if HAS_W:
        scale = _load_scale(W, cols, col_ok, CDT, ZERO_CENTERED)[None, :]  # (1, BLOCK_D)
    if FROM_Y:  # the recovery's per-channel values, each (1, BLOCK_D)
        if not HAS_W:
            scale = tl.zeros((1, BLOCK_D), CDT)  # a placeholder: no scale
        shift, kcol = _from_y_params(B, KMAP, cols, col_ok, CDT, HAS_B, HAS_KEPT)
        shift = shift[None, :]
        kcol = kcol[None, :]
    acc_dw = tl.zeros((ROWS, BLOCK_D), dtype=CDT)
    acc_db = tl.zeros((ROWS, BLOCK_D), dtype=CDT)
    for tile in tl.range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_D)
        rows64 = rows.to(tl.int64)
        xn = tl.load(XN + rows64[:, None] * stride_xn + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        xn = xn.to(CDT)  # (ROWS, BLOCK_D) y when FROM_Y
        dy = dy.to(CDT)  # (ROWS, BLOCK_D)
        if FROM_Y:
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)
            xhat = _xhat_from_y(xn, shift, scale, kcol, KEPT, rows64[:, None] * stride_kept,
                                mask, HAS_W, HAS_B, HAS_KEPT)  # (ROWS, BLOCK_D)
            if HAS_ROWS:
                ridx = tl.load(ROWMAP + rows, mask=row_ok, other=-1)  # (ROWS,)
                if tl.max(ridx, axis=0) >= 0:  # rare: a row of the tile is kept whole
                    xhat = _whole_rows(xhat, XROWS, ridx[:, None], stride_rows, cols[None, :],
                                       mask)
            rstd = tl.where(rstd < 0, NAN, rstd)  # a rescaled row's mark: y cannot give s
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)  # (ROWS,)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)
            scaled = rstd < 0  # (ROWS,) rows the forward computed as xn * s
            s = tl.full((ROWS,), 1.0, CDT)
            if tl.sum(scaled.to(tl.int32), axis=0) > 0:  # rare
                s = tl.where(scaled, _pow2_scale(tl.max(tl.abs(xn), axis=1)), 1.0)
                xn = xn * s[:, None]
            rstd = tl.abs(rstd)
            r_x = tl.where(rstd < INF, rstd, 0.0)  # inf only on a constant row with eps = 0
            if CENTRED:
                u = tl.where(mask, (xn - mean[:, None]) * r_x[:, None], 0.0)  # (ROWS, BLOCK_D)
                xhat = tl.where(mask, u - _div(tl.sum(u, axis=1), n)[:, None], 0.0)  # corrected
            else:
                xhat = xn * r_x[:, None]  # (ROWS, BLOCK_D)
        if HAS_W:
            g = dy * scale
        else:
            g = dy
        mean_gxhat = _div(tl.sum(g * xhat, axis=1), n)  # (ROWS,)
        if CENTRED:
            dn = g - _div(tl.sum(g, axis=1), n)[:, None] - xhat * mean_gxhat[:, None]
        else:
            dn = g - xhat * mean_gxhat[:, None]
        dn = dn * rstd[:, None]  # (ROWS, BLOCK_D)
        if not FROM_Y:
            dn = dn * s[:, None]
        if HAS_DH:
            dh = tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0)
        else:
            dh = dn
        _store_dx(dn, dh, DX, DR, rows64[:, None] * D + cols[None, :], mask, IS_ADD, HAS_DH,
                  WIDE_ADD)
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
    part = pid.to(tl.int64) * D + cols
    if HAS_W:
        tl.store(DW_PART + part, tl.sum(acc_dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + part, tl.sum(acc_db, axis=0), mask=col_ok)


@triton.jit
def _long_row_absmax(
    x_row,  # *: start of the row
    D,  # row length
    CDT: tl.constexpr,  # compute dtype
    BLOCK: tl.constexpr,  # elements per loop step
):
    """max |x| over the row."""
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    big = tl.zeros((BLOCK,), dtype=CDT)
    for start in tl.range(0, D, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < D, other=0.0).to(CDT)
        big = tl.maximum(big, tl.abs(x))
    return tl.max(big, axis=0)


@triton.jit
def _bwd_long_rowstats_kernel(
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    XN,  # *xn.dtype (M, D): what the forward normalized, row stride stride_xn; y when FROM_Y
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, the shift y is recovered with; None unless FROM_Y and HAS_B
    MEAN,  # *T (M,): the forward's MEAN; None when FROM_Y
    RSTD,  # *T (M,): the forward's RSTD (negative: a rescaled row); T, the compute dtype, is
    #        RSTD's dtype
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 if recovered; None unless HAS_KEPT
    KEPT,  # *T (M, k): xhat of the kept channels, row stride stride_kept; None unless HAS_KEPT
    ROWMAP,  # *int32 (M,): row of each row in XROWS, -1 if recovered; None unless HAS_ROWS
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows; None unless HAS_ROWS
    COEF,  # *T (4, M): output, per row mean(u), mean(g), mean(g * xhat) and s
    stride_dy,  # elements between consecutive rows of DY
    stride_xn,  # elements between consecutive rows of XN
    stride_kept,  # elements between consecutive rows of KEPT
    stride_rows,  # elements between consecutive rows of XROWS
    M,  # number of rows
    D,  # row length
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm (mean(u) = mean(g) = 0)
    HAS_W: tl.constexpr,  # weight present
    HAS_B: tl.constexpr,  # FROM_Y: bias present, the shift
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FROM_Y: tl.constexpr,  # XN is y: xhat = (y - shift) / scale, or KEPT on kept channels,
    #                        or XROWS on rows kept whole
    HAS_KEPT: tl.constexpr,  # FROM_Y with k > 0 kept channels
    HAS_ROWS: tl.constexpr,  # FROM_Y with r > 0 rows kept whole
    BLOCK: tl.constexpr,  # elements per loop step
):
    # One program per long row, one pass over it for the row reductions dx needs (one more,
    # for max|xn|, on a rescaled row). With u = (xn * s - MEAN) * rstd and xhat = u - mean(u):
    #     sum(g * xhat) = sum(g * u) - mean(u) * sum(g).
    # FROM_Y: u = xhat, recovered from y (mean(u) = 0, s = 1).
    CDT: tl.constexpr = RSTD.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    xn_row = XN + row * stride_xn
    dy_row = DY + row * stride_dy
    s = tl.full([], 1.0, CDT)
    if HAS_ROWS:
        ridx = tl.load(ROWMAP + row)  # the row's row in XROWS, -1: recovered
    if not FROM_Y:
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        if rstd < 0:  # rare: the forward computed the row as xn * s
            s = _pow2_scale(_long_row_absmax(xn_row, D, CDT, BLOCK))
        rstd = tl.abs(rstd)
        r_x = tl.where(rstd < INF, rstd, 0.0)  # inf only on a constant row with eps = 0
    n = tl.zeros([], CDT) + D  # D in the compute dtype (D may be the constant 1)
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    sum_u = tl.zeros((BLOCK,), dtype=CDT)  # blocked sums: one lane per column mod BLOCK
    sum_g = tl.zeros((BLOCK,), dtype=CDT)
    sum_gu = tl.zeros((BLOCK,), dtype=CDT)
    for start in tl.range(0, D, BLOCK):
        ok = start + cols < D
        if FROM_Y:
            y = tl.load(xn_row + start + cols, mask=ok, other=0.0).to(CDT)
        else:
            xn = tl.load(xn_row + start + cols, mask=ok, other=0.0).to(CDT) * s
        g = tl.load(dy_row + start + cols, mask=ok, other=0.0).to(CDT)
        if HAS_W:
            w = _load_scale(W, start + cols, ok, CDT, ZERO_CENTERED)
            g = g * w
        if FROM_Y:
            if not HAS_W:
                w = g  # a placeholder: no scale
            shift, kcol = _from_y_params(B, KMAP, start + cols, ok, CDT, HAS_B, HAS_KEPT)
            u = _xhat_from_y(y, shift, w, kcol, KEPT, row * stride_kept, ok, HAS_W, HAS_B,
                             HAS_KEPT)  # (BLOCK,) xhat
            if HAS_ROWS:
                if ridx >= 0:  # rare: the row is kept whole, its xhat stored
                    u = tl.load(XROWS + ridx.to(tl.int64) * stride_rows + start + cols,
                                mask=ok, other=0.0)
            if CENTRED:
                sum_g += g
        else:
            if CENTRED:
                u = tl.where(ok, (xn - mean) * r_x, 0.0)  # (BLOCK,)
                sum_u += u
                sum_g += g
            else:
                u = xn * r_x  # (BLOCK,) xhat
        sum_gu += g * u
    if CENTRED and FROM_Y:
        mean_u = tl.zeros([], CDT)
        total_g = tl.sum(sum_g, axis=0)
        mean_g = _div(total_g, n)
        mean_gxhat = _div(tl.sum(sum_gu, axis=0), n)
    elif CENTRED:
        mean_u = _div(tl.sum(sum_u, axis=0), n)
        total_g = tl.sum(sum_g, axis=0)
        mean_g = _div(total_g, n)
        mean_gxhat = _div(tl.sum(sum_gu, axis=0) - mean_u * total_g, n)
    else:
        mean_u = tl.zeros([], CDT)
        mean_g = mean_u
        mean_gxhat = _div(tl.sum(sum_gu, axis=0), n)
    tl.store(COEF + row, mean_u)
    tl.store(COEF + M + row, mean_g)
    tl.store(COEF + 2 * M + row, mean_gxhat)
    tl.store(COEF + 3 * M + row, s)


@triton.jit
def _bwd_long_dx_kernel(
    DY,  # *dy.dtype (M, D): gradient of y, row stride stride_dy, unit column stride
    DH,  # *dh.dtype (M, D): gradient of h, row stride stride_dh; None unless HAS_DH
    XN,  # *xn.dtype (M, D): what the forward normalized, row stride stride_xn; y when FROM_Y
    DX,  # *dx.dtype (M, D) contiguous: output, gradient of x
    DR,  # *dr.dtype (M, D) contiguous: output, gradient of the residual; None unless IS_ADD
    W,  # *w.dtype (D,): weight, or None when HAS_W is False
    B,  # *b.dtype (D,): bias, the shift y is recovered with; None unless FROM_Y and HAS_B
    MEAN,  # *T (M,): the forward's MEAN; None when FROM_Y
    RSTD,  # *T (M,): the forward's RSTD (negative: a rescaled row); T, the compute dtype, is
    #        RSTD's dtype. FROM_Y: the row's 1 / sqrt(var + eps), never negative
    KMAP,  # *int32 (D,): column of each channel in KEPT, -1 if recovered; None unless HAS_KEPT
    KEPT,  # *T (M, k): xhat of the kept channels, row stride stride_kept; None unless HAS_KEPT
    ROWMAP,  # *int32 (M,): row of each row in XROWS, -1 if recovered; None unless HAS_ROWS
    XROWS,  # *T (r, D): xhat of the rows kept whole, row stride stride_rows; None unless HAS_ROWS
    COEF,  # *T (4, M): per row mean(u), mean(g), mean(g * xhat), s from the row-stats kernel
    DW_PART,  # *T (P, D): output, row p = chunk p's sum of dy * xhat
    DB_PART,  # *T (P, D): output, row p = chunk p's sum of dy
    stride_dy,  # elements between consecutive rows of DY
    stride_dh,  # elements between consecutive rows of DH
    stride_xn,  # elements between consecutive rows of XN
    stride_kept,  # elements between consecutive rows of KEPT
    stride_rows,  # elements between consecutive rows of XROWS
    M,  # number of rows
    D,  # row length
    rows_per_chunk,  # rows owned by one program along axis 0
    CENTRED: tl.constexpr,  # LayerNorm, else RMSNorm
    IS_ADD: tl.constexpr,  # add-norm: write dx and dresidual
    HAS_DH: tl.constexpr,  # dh present
    WIDE_ADD: tl.constexpr,  # the add's compute dtype is float64
    HAS_W: tl.constexpr,  # weight present: compute dw partial sums
    HAS_B: tl.constexpr,  # bias present: compute db partial sums (and, FROM_Y, shift by it)
    ZERO_CENTERED: tl.constexpr,  # scale = 1 + w
    FROM_Y: tl.constexpr,  # XN is y: xhat = (y - shift) / scale, or KEPT on kept channels,
    #                        or XROWS on rows kept whole
    HAS_KEPT: tl.constexpr,  # FROM_Y with k > 0 kept channels
    HAS_ROWS: tl.constexpr,  # FROM_Y with r > 0 rows kept whole
    BLOCK: tl.constexpr,  # columns owned by one program along axis 1
):
    # Program (p, j) owns the rows of chunk p and the columns of block j: it writes their dx and
    # row p, block j of the partial sums.
    CDT: tl.constexpr = RSTD.dtype.element_ty
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    ok = cols < D
    if HAS_W:
        scale = _load_scale(W, cols, ok, CDT, ZERO_CENTERED)  # (BLOCK,)
    if FROM_Y:  # the recovery's per-channel values, each (BLOCK,)
        if not HAS_W:
            scale = tl.zeros((BLOCK,), CDT)  # a placeholder: no scale
        shift, kcol = _from_y_params(B, KMAP, cols, ok, CDT, HAS_B, HAS_KEPT)
    acc_dw = tl.zeros((BLOCK,), dtype=CDT)
    acc_db = tl.zeros((BLOCK,), dtype=CDT)
    first = chunk.to(tl.int64) * rows_per_chunk  # int64: row offsets of large tensors
    for row in tl.range(first, tl.minimum(first + rows_per_chunk, M)):
        xn = tl.load(XN + row * stride_xn + cols, mask=ok, other=0.0).to(CDT)  # y when FROM_Y
        dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(CDT)
        if FROM_Y:
            rstd = tl.load(RSTD + row)
            rstd = tl.where(rstd < 0, NAN, rstd)  # a rescaled row's mark: y cannot give s
            mean_g = tl.load(COEF + M + row)
            mean_gxhat = tl.load(COEF + 2 * M + row)
            xhat = _xhat_from_y(xn, shift, scale, kcol, KEPT, row * stride_kept, ok, HAS_W,
                                HAS_B, HAS_KEPT)  # (BLOCK,)
            if HAS_ROWS:
                ridx = tl.load(ROWMAP + row)
                if ridx >= 0:  # rare: the row is kept whole, its xhat stored
                    xhat = tl.load(XROWS + ridx.to(tl.int64) * stride_rows + cols, mask=ok,
                                   other=0.0)
        else:
            mean = tl.load(MEAN + row)
            rstd = tl.abs(tl.load(RSTD + row))
            r_x = tl.where(rstd < INF, rstd, 0.0)  # inf only on a constant row with eps = 0
            mean_u = tl.load(COEF + row)
            mean_g = tl.load(COEF + M + row)
            mean_gxhat = tl.load(COEF + 2 * M + row)
            s = tl.load(COEF + 3 * M + row)
            if CENTRED:
                xhat = tl.where(ok, (xn * s - mean) * r_x - mean_u, 0.0)  # (BLOCK,)
            else:
                xhat = (xn * s) * r_x  # (BLOCK,)
        if HAS_W:
            g = dy * scale
        else:
            g = dy
        dn = (g - mean_g - xhat * mean_gxhat) * rstd  # (BLOCK,)
        if not FROM_Y:
            dn = dn * s
        if HAS_DH:
            dh = tl.load(DH + row * stride_dh + cols, mask=ok, other=0.0)
        else:
            dh = dn
        _store_dx(dn, dh, DX, DR, row * D + cols, ok, IS_ADD, HAS_DH, WIDE_ADD)
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
    part = chunk.to(tl.int64) * D + cols
    if HAS_W:
        tl.store(DW_PART + part, acc_dw, mask=ok)
    if HAS_B:
        tl.store(DB_PART + part, acc_db, mask=ok)


@triton.jit
def _sum_partials_kernel(
    DW_PART,  # *T (P, D): partial sums of dw, or None when HAS_W is False
    DB_PART,  # *T (P, D): partial sums of db, or None when HAS_B is False
    DW,  # *w.dtype (D,): output, dw
    DB,  # *b.dtype (D,): output, db
    P,  # number of partial rows
    D,  # row length
    HAS_W: tl.constexpr,  # reduce DW_PART into DW
    HAS_B: tl.constexpr,  # reduce DB_PART into DB
    BLOCK_P: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    # Second stage: column sums of the partial rows, always in the same order (steps of BLOCK_P
    # rows, then one tree sum), so the result does not depend on scheduling. dw and db are
    # summed in one sweep: the mask and offsets are computed once per step.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < D
    if HAS_W:
        acc_w = tl.zeros((BLOCK_P, BLOCK_N), dtype=DW_PART.dtype.element_ty)
    if HAS_B:
        acc_b = tl.zeros((BLOCK_P, BLOCK_N), dtype=DB_PART.dtype.element_ty)
    for p0 in tl.range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
        mask = (p < P)[:, None] & col_ok[None, :]  # (BLOCK_P, BLOCK_N)
        offs = p.to(tl.int64)[:, None] * D + cols[None, :]  # (BLOCK_P, BLOCK_N)
        if HAS_W:
            acc_w += tl.load(DW_PART + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(DB_PART + offs, mask=mask, other=0.0)
    if HAS_W:
        tl.store(DW + cols, _to(tl.sum(acc_w, axis=0), DW.dtype.element_ty), mask=col_ok)
    if HAS_B:
        tl.store(DB + cols, _to(tl.sum(acc_b, axis=0), DB.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------------------------

INTERPRET: bool = isinstance(_fwd_short_kernel, InterpretedFunction)
"""True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 at import), on CPU."""

_SOFT_BF16 = tl.constexpr(INTERPRET)  # _to rounds to bfloat16 on the bits (the interpreter)
